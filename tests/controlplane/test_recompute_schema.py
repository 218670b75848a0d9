"""The recompute fields of the batch and plan schemas (issue 16, docs/recompute.md): validation
naming the dotted path, value and range; round trips; absent fields mean the old schema exactly;
`kvplane plan --batch` reads and writes them."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys

import pytest

from controlplane.model import Batch, Plan, PlanPolicy, SchemaError
from controlplane.planner import Planner
from controlplane.policy import Policy

BASE = {
    "model": {"layers": 4, "block_size": 1, "block_bytes": 1_000_000},
    "hardware": {"gpu_kv_budget_blocks": 30, "h2d_gbps": 1.0},
    "profile": {"layer_compute_ms": 1.0},
    "requests": [
        {"id": "a", "context_tokens": 8, "slo_tbt_ms": 1e9},
        {"id": "b", "context_tokens": 6, "slo_tbt_ms": 1e9},
    ],
    "policy": {"alpha": 3.0, "window_min": 1, "window_max": 1},
}


def with_recompute(rms=0.05, ratio=0.9) -> dict:
    d = copy.deepcopy(BASE)
    if rms is not None:
        d["profile"]["recompute_ms_per_token"] = rms
    if ratio is not None:
        d["policy"]["max_recompute_ratio"] = ratio
    return d


@pytest.mark.parametrize(
    ("rms", "ratio", "field", "fragment"),
    [
        ([0.1, -0.2, 0.1, 0.1], 0.5, "profile.recompute_ms_per_token[1]", "-0.2 is out of range (allowed >= 0.0)"),
        ([0.1, 0.1], 0.5, "profile.recompute_ms_per_token", "has 2 entries, expected model.layers = 4"),
        ("fast", 0.5, "profile.recompute_ms_per_token", "expected a number, got 'fast'"),
        (0.1, 1.0, "policy.max_recompute_ratio", "1.0 is out of range (allowed [0.0, 1.0))"),
        (0.1, -0.1, "policy.max_recompute_ratio", "-0.1 is out of range (allowed [0.0, 1.0))"),
        (0.1, math.nan, "policy.max_recompute_ratio", "out of range"),
        (0.1, True, "policy.max_recompute_ratio", "expected a number, got True"),
    ],
)
def test_bad_recompute_fields_name_path_value_and_range(rms, ratio, field, fragment):
    """Each bad value raises SchemaError whose field is the dotted path and whose text names the value and range."""
    with pytest.raises(SchemaError) as info:
        Batch.from_dict(with_recompute(rms, ratio))
    assert info.value.field == field
    assert fragment in str(info.value)


def test_good_recompute_fields_are_accepted():
    """Negative control of the validation cases: in-range values (edges included) load."""
    assert Batch.from_dict(with_recompute([0.0, 0.1, 0.2, 0.3], 0.0)).profile.recompute_ms_per_token == (0.0, 0.1, 0.2, 0.3)
    assert Batch.from_dict(with_recompute(0.1, 0.999)).policy.max_recompute_ratio == 0.999
    with pytest.raises(SchemaError, match="policy.max_recompute_ratio"):
        PlanPolicy(max_recompute_ratio=1.0)
    assert PlanPolicy(max_recompute_ratio=0.5).max_recompute_ratio == 0.5


def test_round_trip_with_recompute_fields():
    """from_dict(to_dict(b)) == b with both recompute fields, and to_dict carries them."""
    b = Batch.from_dict(with_recompute([0.1, 0.2, 0.3, 0.4], 0.5))
    d = b.to_dict()
    assert d["profile"]["recompute_ms_per_token"] == [0.1, 0.2, 0.3, 0.4]
    assert d["policy"]["max_recompute_ratio"] == 0.5
    assert Batch.from_dict(json.loads(json.dumps(d))) == b
    # negative control: dropping a field gives a different batch
    del d["policy"]["max_recompute_ratio"]
    assert Batch.from_dict(d) != b


def test_absent_fields_serialise_exactly_as_before():
    """A batch without the recompute fields has none in to_dict (the pre-issue-16 schema)."""
    d = Batch.from_dict(BASE).to_dict()
    assert "recompute_ms_per_token" not in d["profile"]
    assert "max_recompute_ratio" not in d["policy"]
    assert Batch.from_dict(d) == Batch.from_dict(BASE)


@pytest.mark.parametrize(("rms", "ratio"), [(None, None), (0.05, None), (None, 0.9), (0.05, 0.0)])
def test_recompute_offered_only_with_both_fields(rms, ratio):
    """Without the profile figure or with ratio 0 the plan is the old plan exactly (same
    placements, step, memory; no recompute keys in its JSON)."""
    old = Planner(use_mip=False).plan(Batch.from_dict(BASE), time_budget_ms=5_000).to_dict()
    batch = Batch.from_dict(with_recompute(rms, ratio))
    assert not batch.offers_recompute
    new = Planner(use_mip=False).plan(batch, time_budget_ms=5_000).to_dict()
    for d in (old, new):
        d.pop("solve_ms")
    assert new == old
    assert "recompute_blocks" not in new and "transient_blocks" not in new


def test_offered_recompute_changes_the_plan():
    """Negative control of the case above: with both fields this batch recomputes (the joint
    optimum, by hand: both prefixes recomputed in every layer, 6.2 ms vs 54 ms without)."""
    batch = Batch.from_dict(with_recompute())
    assert batch.offers_recompute
    plan = Planner(use_mip=False).plan(batch, time_budget_ms=5_000)
    d = plan.to_dict()
    # a: b = 9, U = min(floor(0.9 * 9), 8) = 8; b: b = 7, U = 6, grid u in {6, 3, 2}
    assert d["recompute_blocks"] == {"a": 8, "b": 3}
    assert d["recompute_layers"] == {"a": 4, "b": 4}
    assert d["transient_blocks"] == 11
    # per layer 1 + (8 + 3) * 0.05 = 1.55 ms, four layers
    assert d["predicted_step_ms"] == pytest.approx(6.2)
    assert d["resident_blocks"] + d["staging_blocks"] + d["transient_blocks"] <= 30


def test_plan_json_keys_only_with_recompute():
    """Plan.to_dict carries recompute_blocks/recompute_layers/transient_blocks only when set."""
    common = dict(
        feasible=True, paused=(), placements={"a": (1, 0)}, predicted_step_ms=1.0,
        window_steps=1, resident_blocks=3, staging_blocks=3, solver="exact", solve_ms=0.1,
    )
    assert "transient_blocks" not in Plan(**common).to_dict()
    d = Plan(**common, recompute_blocks={"a": 2}, recompute_layers={"a": 1}, transient_blocks=2).to_dict()
    assert (d["recompute_blocks"], d["recompute_layers"], d["transient_blocks"]) == ({"a": 2}, {"a": 1}, 2)


def test_policy_carries_the_ratio_to_the_planner():
    """Policy.max_recompute_ratio is validated like its other fields and reaches PlanPolicy."""
    assert Policy(max_recompute_ratio=0.4).plan_policy.max_recompute_ratio == 0.4
    assert Policy().plan_policy.max_recompute_ratio == 0.0
    for bad in (1.0, -0.5, "x"):
        with pytest.raises(SchemaError) as info:
            Policy.from_dict({"max_recompute_ratio": bad})
        assert info.value.field == "max_recompute_ratio"


def _kvplane_plan(tmp_path, payload):
    path = tmp_path / "batch.json"
    path.write_text(json.dumps(payload))
    return subprocess.run(
        [sys.executable, "-m", "kvplane.cli", "plan", "--batch", str(path), "--time-budget-ms", "2000"],
        capture_output=True, text=True, timeout=120,
    )


def test_cli_reads_and_writes_the_extended_schema(tmp_path):
    """`kvplane plan --batch` plans with the recompute fields and prints them; a bad ratio exits 2
    naming the field."""
    out = _kvplane_plan(tmp_path, with_recompute())
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["recompute_blocks"] == {"a": 8, "b": 3} and plan["transient_blocks"] == 11
    bad = _kvplane_plan(tmp_path, with_recompute(ratio=1.5))
    assert bad.returncode == 2
    assert "policy.max_recompute_ratio: 1.5 is out of range (allowed [0.0, 1.0))" in bad.stderr
