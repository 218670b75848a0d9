"""The controller's profile with the worker's recompute cost (issue 16, docs/recompute.md):
predictions of a recomputing placement include the recompute, a layer sample has it taken out,
the figure scales with the learnt compute, and the controller offers recompute only with it."""

from __future__ import annotations

import pytest

from controlplane.api import RequestState, StepReport, WorkerInfo
from controlplane.controller import ProfileTracker
from controlplane.embedded import EmbeddedControlPlane
from controlplane.model import Hardware, ModelSpec, Profile, step_time_ms
from controlplane.policy import Policy
from controlplane.policy_store import PolicyStore

COMP = (1.0, 1.0, 1.0, 1.0)
RMS = (0.5, 0.5, 0.5, 0.5)
BLOCK_BYTES = 1_000_000  # 1 GB/s = 1 block/ms
ROWS = [(1, 1, 1, 1)]
BLOCKS = [4]
REC = [(2, 2)]  # 2 blocks (block_size 1: 2 tokens) recomputed at layers 0-1, fetched at 2-3


def tracker(rms: tuple[float, ...] | None = RMS) -> ProfileTracker:
    return ProfileTracker(Profile(COMP, rms), 1.0, BLOCK_BYTES, block_size=1)


def test_prediction_includes_the_recompute() -> None:
    """By hand: layers 0-1 run 1 + 2 * 0.5 = 2 ms (0-2, 2-4); the prefix of layer 2 (2 blocks at
    1 block/ms) lands at 2, layer 2 runs 4-5; layer 3's fetch 5-7, layer 3 7-8 -> 8 ms."""
    t = tracker()
    assert t.predict_step_ms(ROWS, BLOCKS, REC) == pytest.approx(8.0)
    assert t.predict_step_ms(ROWS, BLOCKS, REC) == step_time_ms(
        ROWS, BLOCKS, COMP, 1.0, recompute=REC, recompute_ms_per_token=RMS, block_size=1)
    assert t.profile == Profile(COMP, RMS)
    # negative controls: without the recompute it is the compute alone; a worker without the figure
    assert t.predict_step_ms(ROWS, BLOCKS) == pytest.approx(4.0)
    assert tracker(None).profile.recompute_ms_per_token is None


def test_layer_sample_has_the_recompute_taken_out() -> None:
    """The layer timer measures a layer with its recompute rows: the EWMA target is the sample less
    u * block_size * rms[l] at layers < k (a = 1: exactly)."""
    t = tracker()
    t.update(ewma_factor=1.0, observed_step_ms=8.0, predicted_step_ms=6.0, placement=ROWS, blocks=BLOCKS,
             layer_compute_sample_ms=(2.5, 2.5, 1.5, 1.5), h2d_gbps_sample=1.0, recompute=REC)
    assert t.layer_compute_ms == pytest.approx((1.5, 1.5, 1.5, 1.5))
    # negative control: the same sample without the recompute taken out
    t2 = tracker()
    t2.update(ewma_factor=1.0, observed_step_ms=8.0, predicted_step_ms=6.0, placement=ROWS, blocks=BLOCKS,
              layer_compute_sample_ms=(2.5, 2.5, 1.5, 1.5), h2d_gbps_sample=1.0)
    assert t2.layer_compute_ms == pytest.approx((2.5, 2.5, 1.5, 1.5)) != t.layer_compute_ms


def test_recompute_cost_scales_with_the_learnt_compute() -> None:
    """Without samples (a = 1) the profile is scaled so the model reproduces the observation,
    recompute included: compute and recompute x1.5, bandwidth / 1.5 (the prefix is fetched)."""
    t = tracker()
    predicted = t.predict_step_ms(ROWS, BLOCKS, REC)
    t.update(ewma_factor=1.0, observed_step_ms=1.5 * predicted, predicted_step_ms=predicted, placement=ROWS,
             blocks=BLOCKS, recompute=REC)
    assert t.predict_step_ms(ROWS, BLOCKS, REC) == pytest.approx(1.5 * predicted)
    assert t.recompute_ms_per_token == pytest.approx(tuple(1.5 * x for x in RMS))
    assert t.h2d_gbps == pytest.approx(1.0 / 1.5)
    # negative control: a pure recompute (k = L, nothing fetched) leaves the bandwidth alone
    t2 = tracker()
    pure = [(2, 4)]
    p2 = t2.predict_step_ms(ROWS, BLOCKS, pure)
    t2.update(ewma_factor=1.0, observed_step_ms=1.5 * p2, predicted_step_ms=p2, placement=ROWS, blocks=BLOCKS,
              recompute=pure)
    assert t2.h2d_gbps == 1.0 and t2.predict_step_ms(ROWS, BLOCKS, pure) == pytest.approx(1.5 * p2)


def test_session_predicts_its_recomputing_plan() -> None:
    """The real embedded controller plans pure recompute for an overflowing request; a step
    observed at the plan's prediction (recompute included) is no profile mismatch, a step at the
    compute alone is one (negative control)."""
    worker = WorkerInfo(worker_id="w", model=ModelSpec(4, 1, 256), hardware=Hardware(2304, 1e-3),
                        profile=Profile(COMP, (0.005,) * 4))
    cp = EmbeddedControlPlane(PolicyStore(Policy(max_recompute_ratio=0.5)), synchronous=True, time_budget_ms=2000)
    try:
        session = cp.open_session(worker)

        def report(step: int, observed: float) -> list:
            running = (RequestState(id="a", context_tokens=700 + step, generated_tokens=1 + step),)
            return session.report(StepReport(step=step, now_ms=float(step), running=running, observed_step_ms=observed))

        plan = report(1, 4.0)[-1].plan
        assert plan.recompute_blocks and plan.placements["a"] == (1, 1, 1, 1)
        assert plan.predicted_step_ms > 1.2 * sum(COMP)  # the recompute is a visible part of the step
        assert report(2, plan.predicted_step_ms) == [] and session.status().last_profile_update is None
        got = report(3, sum(COMP))
        assert got and got[-1].reason == "profile-mismatch"
        assert session.status().last_profile_update is not None
    finally:
        cp.close()
