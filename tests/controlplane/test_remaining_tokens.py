"""RequestSpec.remaining_tokens: a request's growth over the decode window stops at its output
limit (the planner's ``b_r``), through the schema, the wire and the planner."""

from __future__ import annotations

import pytest

from controlplane.model import Batch, RequestSpec, SchemaError
from controlplane.planner import Planner
from controlplane.service import convert
from tests.controlplane.test_planner import make_batch


def test_blocks_grow_over_the_window_up_to_the_remaining_tokens() -> None:
    unknown = RequestSpec("a", context_tokens=100, slo_tbt_ms=50.0)
    assert unknown.blocks(16, 64) == 11  # ceil(164 / 16): the whole window
    short = RequestSpec("a", context_tokens=100, slo_tbt_ms=50.0, remaining_tokens=3)
    assert short.blocks(16, 64) == 7 and short.blocks(16, 2) == 7 and short.blocks(16) == 7
    assert RequestSpec("a", 100, 50.0, remaining_tokens=0).blocks(16, 64) == 7
    assert RequestSpec("a", 100, 50.0, remaining_tokens=100).blocks(16, 64) == 11  # the window binds


def _batch(remaining: object) -> dict:
    request = {"id": "a", "context_tokens": 100, "slo_tbt_ms": 50.0}
    if remaining is not ...:
        request["remaining_tokens"] = remaining
    return {"model": {"layers": 4, "block_size": 16, "block_bytes": 4096},
            "hardware": {"gpu_kv_budget_blocks": 30, "h2d_gbps": 10.0},
            "profile": {"layer_compute_ms": 1.0}, "requests": [request],
            "policy": {"window_min": 64, "window_max": 64}}


def test_schema_round_trips_and_rejects_bad_values() -> None:
    assert Batch.from_dict(_batch(...)).requests[0].remaining_tokens is None
    assert Batch.from_dict(_batch(None)).requests[0].remaining_tokens is None
    batch = Batch.from_dict(_batch(5))
    assert batch.requests[0].remaining_tokens == 5
    assert Batch.from_dict(batch.to_dict()) == batch
    assert "remaining_tokens" not in Batch.from_dict(_batch(...)).to_dict()["requests"][0]
    for bad in (-1, 2.5, "3", True):
        with pytest.raises(SchemaError, match="remaining_tokens"):
            Batch.from_dict(_batch(bad))


def test_the_wire_keeps_known_and_unknown_apart() -> None:
    for remaining in (..., 0, 7):
        batch = Batch.from_dict(_batch(remaining))
        assert convert.batch_from_proto(convert.batch_to_proto(batch)) == batch
    zero = convert.batch_to_proto(Batch.from_dict(_batch(0)))
    unset = convert.batch_to_proto(Batch.from_dict(_batch(...)))
    assert zero.requests[0].HasField("remaining_tokens") and not unset.requests[0].HasField("remaining_tokens")


def test_the_planner_keeps_a_short_request_resident_where_a_window_would_not_fit() -> None:
    """30 blocks hold 4 layers x 7 blocks (the request's remaining growth) but not 4 x 11 (a
    64-step window's); control: unknown remaining tokens offload."""
    layers = {}
    for remaining in (3, ...):
        plan = Planner().plan(Batch.from_dict(_batch(remaining)))
        assert plan.feasible and "a" in plan.placements, plan
        layers[remaining] = plan.placements["a"].count(0)
    assert layers[3] == 0 and layers[...] > 0, layers


def test_make_batch_default_is_unchanged() -> None:
    """Batches without the field plan as before (the planner suites' batches carry none)."""
    assert all(r.remaining_tokens is None for r in make_batch([10, 20]).requests)
