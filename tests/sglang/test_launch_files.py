"""What the launch options' files hold is checked when LayeredKVArgs is built (issue 17).

``--kv-policy``, ``--kv-policy-token-file`` and the ``--kv-tls-*`` files are read with the
control plane's own readers (``kvplane serve`` refuses the same files); each bad file is one
``ValueError`` line naming the flag, the file and the problem, and each check has a valid file
as its negative control. ``test_launch_validation.py`` shows the real launcher's answer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from sglang_ext.args import LayeredKVArgs
from tests.service.certs import ThrowawayCA

REMOTE = "grpc://127.0.0.1:50051"

BAD_POLICIES = {
    "invalid-json": ("p.json", '{"slo_tbt_ms": 100,', "not valid YAML/JSON (Expecting property name"),
    "invalid-yaml": ("p.yaml", "slo_tbt_ms: [1\n  alpha: 2\n", "not valid YAML/JSON (expected ',' or ']'"),
    "negative-slo": ("p.yaml", "slo_tbt_ms: -5\n", "slo_tbt_ms: -5 is out of range"),
    "unknown-key": ("p.json", '{"slo_tbt_msx": 5}', "slo_tbt_msx: unknown policy field"),
    "window-min-above-max": ("p.json", '{"window_min": 10, "window_max": 5}', "window_max: 5 is below window_min = 10"),
    "top-level-list": ("p.json", "[1, 2]", "expected an object at the top level, got list"),
}
"""Issue 17's bad --kv-policy contents: file name, content, the problem the message states."""


@pytest.mark.parametrize("case", sorted(BAD_POLICIES))
def test_bad_policy_file_names_flag_file_and_problem(tmp_path: Path, case: str) -> None:
    """A policy file the control plane would refuse is refused at launch, in one line."""
    name, content, problem = BAD_POLICIES[case]
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError) as info:
        LayeredKVArgs(enable_layered_kv=True, kv_policy=str(path))
    message = str(info.value)
    assert message.startswith(f"--kv-policy: policy file {str(path)!r}: ") and "\n" not in message
    assert problem in message


def test_valid_policy_file_is_accepted(tmp_path: Path) -> None:
    """Negative control: a partial valid policy (JSON and YAML) passes."""
    (tmp_path / "p.json").write_text('{"slo_tbt_ms": 150, "window_min": 4, "window_max": 32}')
    (tmp_path / "p.yaml").write_text("slo_tbt_ms: 150\nalpha: 0.5\n")
    for name in ("p.json", "p.yaml"):
        assert LayeredKVArgs(enable_layered_kv=True, kv_policy=str(tmp_path / name)).kv_policy


@pytest.mark.parametrize("content", ["", "  \n\t\n"], ids=["empty", "whitespace"])
def test_empty_token_file_is_refused_as_the_service_does(tmp_path: Path, content: str) -> None:
    """An empty (or whitespace-only) token file is refused, as `kvplane serve --policy-token-file`."""
    token = tmp_path / "token"
    token.write_text(content)
    with pytest.raises(ValueError, match=r"^--kv-policy-token-file: token file '.*token': is empty"):
        LayeredKVArgs(kv_control_plane=REMOTE, kv_policy_token_file=str(token))


@pytest.mark.parametrize("content", ["A" * 64 + "\n" + "B" * 24 + "\n", "tok\u00e9n"], ids=["two-lines", "non-ascii"])
def test_token_gRPC_metadata_cannot_carry_is_refused_as_the_service_does(tmp_path: Path, content: str) -> None:
    """A two-line (`openssl rand -base64 64`) or non-ASCII token is refused at launch, naming the
    flag and the file. Negative control: the old reader accepted both (the worker then failed
    every call with 'Invalid metadata')."""
    token = tmp_path / "token"
    token.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=r"^--kv-policy-token-file: token file '.*token': character \d+ of the token is "):
        LayeredKVArgs(kv_control_plane=REMOTE, kv_policy_token_file=str(token))


def test_token_file_with_a_token_is_accepted(tmp_path: Path) -> None:
    """Negative control: a token surrounded by whitespace passes."""
    token = tmp_path / "token"
    token.write_text("\n tok-123 \n")
    assert LayeredKVArgs(kv_control_plane=REMOTE, kv_policy_token_file=str(token)).kv_policy_token_file


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA, a worker certificate and its key, another key, an encrypted key and garbage files."""
    root = tmp_path_factory.mktemp("pki")
    ca = ThrowawayCA()
    worker, other = ca.issue("worker", server=False), ca.issue("other", server=False)
    encrypted = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret"),
    )
    files = {
        "ca": ca.cert_pem, "cert": worker.cert_pem, "key": worker.key_pem, "other-key": other.key_pem,
        "encrypted-key": encrypted, "text": b"not a certificate\n",
        "bad-block": b"-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n",
    }
    for name, data in files.items():
        (root / name).write_bytes(data)
    return {name: root / name for name in files}


@pytest.mark.parametrize("garbage", ["text", "bad-block", "key"])
def test_garbage_ca_is_refused(pki: dict[str, Path], garbage: str) -> None:
    """--kv-tls-ca without a certificate that parses (text, a broken block, a key) is refused."""
    with pytest.raises(ValueError, match=r"^--kv-tls-ca='.*': not a PEM certificate file \("):
        LayeredKVArgs(kv_control_plane=REMOTE, kv_tls_ca=str(pki[garbage]))


@pytest.mark.parametrize(
    ("cert", "key", "message"),
    [
        ("text", "key", r"^--kv-tls-cert='.*text': not a PEM certificate file"),
        ("bad-block", "key", r"^--kv-tls-cert='.*bad-block': not a PEM certificate file"),
        ("cert", "text", r"^--kv-tls-key='.*text': not an unencrypted PEM private key"),
        ("cert", "cert", r"^--kv-tls-key='.*cert': not an unencrypted PEM private key"),
        ("cert", "encrypted-key", r"^--kv-tls-key='.*encrypted-key': not an unencrypted PEM private key"),
        ("cert", "other-key", r"^--kv-tls-key='.*other-key': does not belong to the certificate in --kv-tls-cert="),
    ],
)
def test_garbage_client_cert_or_key_is_refused(pki: dict[str, Path], cert: str, key: str, message: str) -> None:
    """The client certificate must parse and the key must be unencrypted and belong to it."""
    with pytest.raises(ValueError, match=message):
        LayeredKVArgs(kv_control_plane=REMOTE, kv_tls_cert=str(pki[cert]), kv_tls_key=str(pki[key]))


def test_valid_tls_material_is_accepted(pki: dict[str, Path]) -> None:
    """Negative control: the CA, and the worker's certificate with its own key, pass."""
    args = LayeredKVArgs(
        kv_control_plane=REMOTE, kv_tls_ca=str(pki["ca"]), kv_tls_cert=str(pki["cert"]), kv_tls_key=str(pki["key"])
    )
    assert args.kv_tls_ca and args.kv_tls_cert and args.kv_tls_key
