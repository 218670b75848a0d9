"""ConfigMap template: the policy file the server loads with --policy."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from controlplane.model.batch import SchemaError
from controlplane.policy import Policy
from tests.helm.conftest import FULLNAME


def _policy(rendered) -> dict:
    cm = rendered.one("ConfigMap")
    assert cm["metadata"]["name"] == FULLNAME
    assert set(cm["data"]) == {"policy.yaml"}
    return yaml.safe_load(cm["data"]["policy.yaml"])


def test_default_policy_loads_in_server(render):
    """The default policy file is accepted by controlplane.policy.Policy and equals its defaults."""
    policy = Policy.from_dict(_policy(render()))
    assert policy == Policy()


def test_policy_overrides_reach_the_file(render):
    """Values under policy: land in policy.yaml and load as the same Policy."""
    values = {
        "policy": {"scheduler": "lvf", "slo_tbt_ms": 120, "window_max": 32, "lvf": {"beta_b": 0.25}}
    }
    policy = Policy.from_dict(_policy(render(values)))
    assert policy.scheduler == "lvf"
    assert policy.slo_tbt_ms == 120
    assert policy.window_max == 32
    assert policy.lvf.beta_b == 0.25
    assert policy.lvf.beta_f == Policy().lvf.beta_f


def test_values_cover_every_policy_field(render):
    """values.yaml names every tunable Policy field (all but the server-assigned version)."""
    fields = {f.name for f in dataclasses.fields(Policy)} - {"version"}
    assert set(_policy(render())) == fields
    nested = _policy(render())
    assert set(nested["layerkv"]) == {f.name for f in dataclasses.fields(Policy().layerkv)}
    assert set(nested["lvf"]) == {f.name for f in dataclasses.fields(Policy().lvf)}


def test_rendered_policy_is_valid_yaml_mapping_only(render):
    """policy.yaml is a plain mapping (no comments or templating leftovers)."""
    text = render().one("ConfigMap")["data"]["policy.yaml"]
    assert "{{" not in text and "#" not in text
    assert isinstance(yaml.safe_load(text), dict)


def test_bad_policy_is_rejected_before_the_server_sees_it(render_error):
    """A policy value the server would reject fails `helm template` instead."""
    with pytest.raises(SchemaError):
        Policy.from_dict({"ewma_factor": 1.5})
    assert "policy.ewma_factor" in render_error({"policy": {"ewma_factor": 1.5}})
