"""ServiceAccount template."""

from __future__ import annotations

from tests.helm.conftest import FULLNAME


def test_created_without_api_token(render):
    """A dedicated ServiceAccount is created and does not automount an API token."""
    r = render()
    sa = r.one("ServiceAccount")
    assert sa["metadata"]["name"] == FULLNAME
    assert sa["automountServiceAccountToken"] is False
    assert r.one("Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == FULLNAME


def test_existing_service_account(render):
    """create=false renders no ServiceAccount and the pods use the named one."""
    r = render({"serviceAccount": {"create": False, "name": "shared-sa"}})
    assert r.maybe("ServiceAccount") is None
    assert r.one("Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "shared-sa"


def test_named_and_annotated(render):
    """serviceAccount.name and annotations apply to the created account."""
    sa = render(
        {
            "serviceAccount": {
                "create": True,
                "name": "kv-sa",
                "annotations": {"iam.example/role": "kv"},
            }
        }
    ).one("ServiceAccount")
    assert sa["metadata"]["name"] == "kv-sa"
    assert sa["metadata"]["annotations"] == {"iam.example/role": "kv"}
