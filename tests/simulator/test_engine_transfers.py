"""What the engine charges and records around transfers: a prefill step's memory counts the
prompts it admits, and overlapped swaps run full duplex (SuperInfer §4.3, DuplexKV)."""

from __future__ import annotations

import pytest

from simulator.engine import Engine, SimConfig
from simulator.policies.lvf import LvfPolicy
from simulator.profile import load_profile
from simulator.state import Actions
from simulator.trace import TraceRequest
from tests.simulator.helpers import A5000, run


def test_a_prefill_step_counts_the_prompt_it_admits():
    """One 4096-token prompt, all on the GPU: the prefill step holds its every layer (the step
    record said 0 before: the admitted prompt was not running yet). Control: the first decode
    step holds the same plus the one token it decodes."""
    prof = load_profile(A5000)
    trace = [TraceRequest("A", 0.0, 4096, 4, 1e6, 1e6)]
    res = run("no-offload", prof, trace)
    prefill = [s for s in res.step_log if s.kind == "prefill"]
    decode = [s for s in res.step_log if s.kind == "decode"]
    prompt_blocks = prof.blocks(4096) * prof.layers
    assert prefill[0].used_blocks == prompt_blocks
    assert decode[0].used_blocks >= prompt_blocks
    assert res.max_used_blocks >= prompt_blocks


def test_an_offloaded_prompt_counts_its_resident_layers_and_one_staging_slot():
    """A prompt admitted with some layers offloaded at prefill holds its GPU layers plus a
    staging slot of one layer during the prefill step, as admission counted it (before: the
    staging slot alone)."""
    prof = load_profile(A5000)
    ctx = 30_000  # above what the GPU holds: some layers go to host memory at prefill
    res = run("orbitflow", prof, [TraceRequest("A", 0.0, ctx, 4, 1e6, 1e6)])
    (req,) = res.requests
    assert req.min_gpu_layers is not None and 0 < req.min_gpu_layers < prof.layers
    prefill = next(s for s in res.step_log if s.kind == "prefill")
    per_layer = prof.blocks(ctx)
    assert prefill.used_blocks == per_layer * (req.min_gpu_layers + 1)
    assert prefill.used_blocks <= prof.gpu_kv_budget_blocks


class _Rotate(LvfPolicy):
    """Admit A and B, swap B out, then in one step swap A out while B comes back."""

    name = "rotate-script"

    def decide(self, view):  # noqa: ANN001, ANN201
        if view.step == 3:
            return Actions(preempt_swap=["B"])
        if view.step == 5:
            return Actions(preempt_swap=["A"], resume=["B"])
        if view.step == 7:
            return Actions(resume=["A"])
        if view.queued and view.step < 3:
            return Actions(admit=[view.queued[0].id])
        return Actions()


def _rotation_steps(overlap: bool) -> tuple[float, float, float]:
    """(the step swapping B out alone, the step swapping A out and B in, one direction's ms)."""
    prof = load_profile(A5000)
    policy = _Rotate()
    policy.overlap_swaps = overlap
    trace = [TraceRequest(x, 0.0, 4000, 20, 1e6, 1e6) for x in ("A", "B")]
    res = Engine(prof, trace, policy, SimConfig(record_steps=True)).run()
    steps = {s.step: s for s in res.step_log}
    one_way = prof.blocks(4000 + 3) * prof.layers / prof.d2h_blocks_per_ms
    assert prof.h2d_blocks_per_ms == prof.d2h_blocks_per_ms
    return steps[3].dur_ms, steps[5].dur_ms, one_way


def test_overlapped_swaps_in_both_directions_take_the_longer_one():
    """DuplexKV is full duplex: a step that swaps A out (D2H) while B comes in (H2D) takes as
    long as one swap alone, not the two added (138.5 ms on this preset before)."""
    out_only, both, one_way = _rotation_steps(overlap=True)
    assert out_only == pytest.approx(one_way, rel=1e-6)  # the swap hides the step's compute
    assert both == pytest.approx(out_only, rel=1e-6)
    assert both < 1.5 * one_way


def test_serial_swaps_still_add_up():
    """Control: swaps that stop the step (vLLM's swap, ``overlap_swaps = False``) are charged
    one after the other: the two-way step costs one swap more than the one-way step."""
    out_only, both, one_way = _rotation_steps(overlap=False)
    assert both - out_only == pytest.approx(one_way, rel=1e-6)
