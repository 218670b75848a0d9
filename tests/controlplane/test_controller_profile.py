"""ProfileTracker: EWMA of per-layer compute and bandwidth, fitted when samples are missing."""

from __future__ import annotations

import pytest

from controlplane.controller import ProfileTracker
from controlplane.controller.profile_tracker import GBPS_RANGE, MAX_TELEMETRY_MS
from controlplane.model import Profile, step_time_ms

COMP = (1.0, 2.0, 1.0, 2.0)
BLOCK_BYTES = 1_000_000  # 1 GB/s = 1 block/ms
ROWS = [(1, 0, 1, 0), (0, 1, 1, 1)]  # transfers on the link
BLOCKS = [4, 3]


def tracker(gbps: float = 2.0) -> ProfileTracker:
    return ProfileTracker(Profile(COMP), gbps, BLOCK_BYTES)


def test_samples_move_compute_and_bandwidth_by_ewma() -> None:
    """With both samples: comp = (1-a)comp + a*sample and bw = (1-a)bw + a*sample, exactly."""
    t = tracker()
    a = 0.3
    t.update(
        ewma_factor=a,
        observed_step_ms=20.0,
        predicted_step_ms=10.0,
        placement=ROWS,
        blocks=BLOCKS,
        layer_compute_sample_ms=(2.0, 2.0, 2.0, 2.0),
        h2d_gbps_sample=1.0,
    )
    assert t.layer_compute_ms == pytest.approx(tuple(0.7 * c + 0.3 * 2.0 for c in COMP))
    assert t.h2d_gbps == pytest.approx(0.7 * 2.0 + 0.3 * 1.0)


def test_no_samples_scale_profile_so_model_reproduces_observation() -> None:
    """Without samples and a=1 the updated profile predicts exactly the observed step."""
    t = tracker()
    predicted = t.predict_step_ms(ROWS, BLOCKS)
    t.update(
        ewma_factor=1.0,
        observed_step_ms=1.5 * predicted,
        predicted_step_ms=predicted,
        placement=ROWS,
        blocks=BLOCKS,
    )
    assert t.predict_step_ms(ROWS, BLOCKS) == pytest.approx(1.5 * predicted)
    assert t.layer_compute_ms == pytest.approx(tuple(1.5 * c for c in COMP))
    assert t.h2d_gbps == pytest.approx(2.0 / 1.5)


def test_compute_sample_only_fits_bandwidth_to_observation() -> None:
    """A compute sample with transfers and no bandwidth sample fits the bandwidth (a=1: exact)."""
    t = tracker(gbps=4.0)
    predicted = t.predict_step_ms(ROWS, BLOCKS)
    observed = predicted * 1.8
    t.update(
        ewma_factor=1.0,
        observed_step_ms=observed,
        predicted_step_ms=predicted,
        placement=ROWS,
        blocks=BLOCKS,
        layer_compute_sample_ms=COMP,
    )
    assert t.layer_compute_ms == COMP
    assert t.h2d_gbps < 4.0
    assert step_time_ms(ROWS, BLOCKS, COMP, t.bw_blocks_per_ms()) == pytest.approx(
        observed, rel=1e-6
    )


def test_bandwidth_sample_only_fits_compute_to_observation() -> None:
    """A bandwidth sample with no compute sample scales compute to explain the rest (a=1: exact)."""
    t = tracker(gbps=4.0)
    predicted = t.predict_step_ms(ROWS, BLOCKS)
    observed = predicted * 1.3
    t.update(
        ewma_factor=1.0,
        observed_step_ms=observed,
        predicted_step_ms=predicted,
        placement=ROWS,
        blocks=BLOCKS,
        h2d_gbps_sample=4.0,
    )
    assert t.h2d_gbps == 4.0
    assert t.predict_step_ms(ROWS, BLOCKS) == pytest.approx(observed, rel=1e-6)


def test_no_transfers_leave_bandwidth_alone() -> None:
    """An all-GPU step says nothing about the link: bandwidth is unchanged."""
    t = tracker()
    rows = [(1, 1, 1, 1)]
    t.update(
        ewma_factor=0.5, observed_step_ms=12.0, predicted_step_ms=6.0, placement=rows, blocks=[3]
    )
    assert t.h2d_gbps == 2.0
    assert t.layer_compute_ms == pytest.approx(tuple(c * 1.5 for c in COMP))


def test_mismatch_is_relative_error() -> None:
    """mismatch = |observed - predicted| / predicted."""
    assert ProfileTracker.mismatch(12.0, 10.0) == pytest.approx(0.2)
    assert ProfileTracker.mismatch(8.0, 10.0) == pytest.approx(0.2)
    assert ProfileTracker.mismatch(1.0, 0.0) == float("inf")


def test_samples_leave_the_gap_to_the_fetch_launch_cost() -> None:
    """Compute and bandwidth sampled, transfers in the placement: the gap the samples leave is the
    launches' (controlplane.model.timeline): a=1 fits the truth exactly, EWMA converges to it."""
    gbps, truth = 20.0, 0.4
    observed = step_time_ms(ROWS, BLOCKS, list(COMP), gbps, launch_ms=truth)
    assert observed > step_time_ms(ROWS, BLOCKS, list(COMP), gbps) + 0.5  # the launches show
    t = tracker(gbps=gbps)
    update = t.update(ewma_factor=1.0, observed_step_ms=observed, predicted_step_ms=t.predict_step_ms(ROWS, BLOCKS),
                      placement=ROWS, blocks=BLOCKS, layer_compute_sample_ms=COMP, h2d_gbps_sample=gbps)
    assert t.fetch_launch_ms == pytest.approx(truth, rel=1e-6)
    assert (update.old_fetch_launch_ms, update.new_fetch_launch_ms) == (0.0, t.fetch_launch_ms)
    assert t.predict_step_ms(ROWS, BLOCKS) == pytest.approx(observed, rel=1e-6)
    assert t.profile.fetch_launch_ms == t.fetch_launch_ms
    slow = tracker(gbps=gbps)
    for _ in range(12):
        slow.update(ewma_factor=0.5, observed_step_ms=observed, predicted_step_ms=slow.predict_step_ms(ROWS, BLOCKS),
                    placement=ROWS, blocks=BLOCKS, layer_compute_sample_ms=COMP, h2d_gbps_sample=gbps)
    assert slow.fetch_launch_ms == pytest.approx(truth, rel=1e-3)
    # negative control: without the bandwidth sample the same gap is taken for a slower link and
    # the launch cost stays where it was
    blind = tracker(gbps=gbps)
    blind.update(ewma_factor=1.0, observed_step_ms=observed, predicted_step_ms=blind.predict_step_ms(ROWS, BLOCKS),
                 placement=ROWS, blocks=BLOCKS, layer_compute_sample_ms=COMP)
    assert blind.fetch_launch_ms == 0.0 and blind.h2d_gbps < gbps
    # nor is the first step of a new placement (it also moved pages) evidence of the launch cost
    moved = tracker(gbps=gbps)
    moved.update(ewma_factor=1.0, observed_step_ms=observed, predicted_step_ms=moved.predict_step_ms(ROWS, BLOCKS),
                 placement=ROWS, blocks=BLOCKS, layer_compute_sample_ms=COMP, h2d_gbps_sample=gbps, steady=False)
    assert moved.fetch_launch_ms == 0.0
    # nothing fetched: no evidence about launches
    resident = tracker(gbps=gbps)
    rows = [(1, 1, 1, 1)] * 2
    resident.update(ewma_factor=1.0, observed_step_ms=9.0, predicted_step_ms=6.0, placement=rows, blocks=BLOCKS,
                    layer_compute_sample_ms=(1.5, 3.0, 1.5, 3.0), h2d_gbps_sample=gbps)
    assert resident.fetch_launch_ms == 0.0


def test_no_samples_scale_the_launch_cost_with_the_profile() -> None:
    """The homogeneous update scales every time constant, the launch cost too: the updated
    profile reproduces the observation exactly (a=1)."""
    t = ProfileTracker(Profile(COMP, fetch_launch_ms=0.3), 20.0, BLOCK_BYTES)
    predicted = t.predict_step_ms(ROWS, BLOCKS)
    t.update(ewma_factor=1.0, observed_step_ms=2.0 * predicted, predicted_step_ms=predicted, placement=ROWS,
             blocks=BLOCKS)
    assert t.fetch_launch_ms == pytest.approx(0.6)
    assert t.predict_step_ms(ROWS, BLOCKS) == pytest.approx(2.0 * predicted)


def test_a_replan_that_keeps_the_placement_places_like_it() -> None:
    """Plan.places_like (the session controller's steadiness, launch-cost evidence): the same
    placements and recompute are alike; another placement or recompute is not."""
    from controlplane.model import Plan

    def plan(placements: dict, rec: dict | None = None) -> Plan:
        return Plan(feasible=True, paused=(), placements=placements, predicted_step_ms=1.0, window_steps=1,
                    resident_blocks=0, staging_blocks=0, solver="t", solve_ms=0.0,
                    recompute_blocks=dict(rec or {}), recompute_layers={k: 2 for k in rec or {}})

    a = plan({"r": (1, 0, 1)})
    assert a.places_like(a) and a.places_like(plan({"r": (1, 0, 1)}))
    assert not a.places_like(plan({"r": (0, 1, 1)}))
    assert not a.places_like(plan({"r": (1, 0, 1)}, {"r": 1}))


def test_a_bandwidth_sample_of_a_step_that_fetched_nothing_is_no_evidence() -> None:
    """A report's bandwidth sample (copies of earlier steps, carried over) moves the link only when
    the placement that ran transferred; negative control: the same sample with transfers does."""
    idle = tracker(gbps=2.0)
    rows = [(1, 1, 1, 1)] * 2
    idle.update(ewma_factor=1.0, observed_step_ms=9.0, predicted_step_ms=6.0, placement=rows, blocks=BLOCKS,
                layer_compute_sample_ms=(1.5, 3.0, 1.5, 3.0), h2d_gbps_sample=0.3)
    assert idle.h2d_gbps == 2.0
    busy = tracker(gbps=2.0)
    busy.update(ewma_factor=1.0, observed_step_ms=20.0, predicted_step_ms=10.0, placement=ROWS, blocks=BLOCKS,
                layer_compute_sample_ms=COMP, h2d_gbps_sample=0.3)
    assert busy.h2d_gbps == pytest.approx(0.3)


@pytest.mark.parametrize("gbps_sample", [None, 1.0], ids=["no-samples", "bandwidth-sample"])
def test_a_profile_of_zeros_learns_the_compute_from_the_step(gbps_sample: float | None) -> None:
    """A worker's hello with every layer at 0 ms predicts 0 ms for any step, and scaling by
    ``observed / predicted`` (or a compute scale fitted under a bandwidth sample) kept it at 0 for
    good. The step is spread over the layers instead (a=1: each layer 5 ms of a 20 ms step), and a
    second update then scales as usual. Control: a non-zero profile is scaled, not spread."""
    t = ProfileTracker(Profile((0.0,) * 4), 2.0, BLOCK_BYTES)
    rows = [(1, 1, 1, 1)] * 2  # nothing on the link
    assert t.predict_step_ms(rows, BLOCKS) == 0.0
    t.update(ewma_factor=1.0, observed_step_ms=20.0, predicted_step_ms=0.0, placement=rows, blocks=BLOCKS,
             h2d_gbps_sample=gbps_sample)
    assert t.layer_compute_ms == pytest.approx((5.0,) * 4)
    assert t.predict_step_ms(rows, BLOCKS) == pytest.approx(20.0)
    t.update(ewma_factor=1.0, observed_step_ms=10.0, predicted_step_ms=20.0, placement=rows, blocks=BLOCKS)
    assert t.layer_compute_ms == pytest.approx((2.5,) * 4)
    control = tracker()
    control.update(ewma_factor=1.0, observed_step_ms=12.0, predicted_step_ms=6.0, placement=rows, blocks=BLOCKS)
    assert control.layer_compute_ms == pytest.approx(tuple(2 * c for c in COMP))


def test_a_step_of_no_time_is_no_evidence_even_with_a_layer_sample() -> None:
    """Scenario (control-plane review, session 77): ``observed_step_ms`` 0 is broken telemetry and
    left the profile alone, but only without a layer sample: with one, the bandwidth was fitted
    to a 0 ms step and took its 1000x clamp (a=1 here: 2 -> 2000 GB/s). Now the profile stays.
    Control: the same sample with a true step time moves it."""
    for observed, moved in ((0.0, False), (1.8 * tracker(4.0).predict_step_ms(ROWS, BLOCKS), True)):
        t = tracker(gbps=4.0)
        t.update(ewma_factor=1.0, observed_step_ms=observed, predicted_step_ms=t.predict_step_ms(ROWS, BLOCKS),
                 placement=ROWS, blocks=BLOCKS, layer_compute_sample_ms=tuple(c / 2 for c in COMP))
        assert (t.layer_compute_ms != COMP or t.h2d_gbps != 4.0) is moved, (observed, t.layer_compute_ms, t.h2d_gbps)


@pytest.mark.parametrize("field", ["observed", "layer", "gbps"])
def test_telemetry_beyond_its_bounds_is_no_evidence(field: str) -> None:
    """Scenario (control-plane review, session 80): finite but absurd telemetry (a 1.7e308 ms step,
    a layer of 1.7e308 ms, a 1e9 GB/s link) passed validation and moved the profile; two such
    steps inflated it to ~1e305 ms a layer, the next true step's scale sent the bandwidth to inf,
    and every later plan failed. Now it leaves the profile alone. Control: the same report at the
    bound moves it."""
    def report(bad: bool) -> dict:
        big = 1.7e308 if bad else MAX_TELEMETRY_MS
        return {
            "observed_step_ms": big if field == "observed" else 20.0,
            "layer_compute_sample_ms": (big,) * 4 if field == "layer" else None,
            "h2d_gbps_sample": (1e9 if bad else GBPS_RANGE[1]) if field == "gbps" else None,
        }
    for bad in (True, False):
        t = tracker()
        t.update(ewma_factor=0.5, predicted_step_ms=10.0, placement=ROWS, blocks=BLOCKS, **report(bad))
        assert (t.layer_compute_ms == COMP and t.h2d_gbps == 2.0) is bad, (bad, t.layer_compute_ms, t.h2d_gbps)


def test_a_scale_far_beyond_the_bounds_keeps_the_profile_finite() -> None:
    """A near-zero profile (layers of 5e-324 ms: valid) predicts ~0 ms, so a true step's scale is
    ~1e300: the targets are held within the bounds and the profile stays finite, the bandwidth in
    ``GBPS_RANGE``, through any mix of such steps (before: inf, then NaN). Control: without the
    near-zero profile the same steps scale it as usual."""
    t = ProfileTracker(Profile((5e-324,) * 4), 2.0, BLOCK_BYTES)
    for observed in (20.0, 5e-300, 1e5, 1e-300, 20.0) * 3:
        t.update(ewma_factor=0.7, observed_step_ms=observed, predicted_step_ms=t.predict_step_ms(ROWS, BLOCKS),
                 placement=ROWS, blocks=BLOCKS)
        assert all(0.0 <= c <= MAX_TELEMETRY_MS for c in t.layer_compute_ms), t.layer_compute_ms
        assert GBPS_RANGE[0] <= t.h2d_gbps <= GBPS_RANGE[1], t.h2d_gbps
        assert 0.0 <= t.fetch_launch_ms <= MAX_TELEMETRY_MS
    control = tracker()
    control.update(ewma_factor=1.0, observed_step_ms=2 * control.predict_step_ms(ROWS, BLOCKS),
                   predicted_step_ms=control.predict_step_ms(ROWS, BLOCKS), placement=ROWS, blocks=BLOCKS)
    assert control.layer_compute_ms == pytest.approx(tuple(2 * c for c in COMP))


def test_the_recompute_cost_stays_finite_from_a_near_zero_profile() -> None:
    """Review of session 80: from layers of 5e-324 ms the compute's ratio new / old is inf, which
    made ``recompute_ms_per_token`` inf (recompute off for good). The cost is kept instead; the
    compute still learns. Control: from a true profile it scales with the compute."""
    t = ProfileTracker(Profile((5e-324,) * 4, recompute_ms_per_token=(0.01,) * 4), 2.0, BLOCK_BYTES)
    rows = [(1, 1, 1, 1)] * 2
    t.update(ewma_factor=0.5, observed_step_ms=20.0, predicted_step_ms=t.predict_step_ms(rows, BLOCKS),
             placement=rows, blocks=BLOCKS)
    assert t.recompute_ms_per_token == (0.01,) * 4 and t.layer_compute_ms[0] > 1.0
    control = ProfileTracker(Profile(COMP, recompute_ms_per_token=(0.01,) * 4), 2.0, BLOCK_BYTES)
    control.update(ewma_factor=1.0, observed_step_ms=12.0, predicted_step_ms=6.0, placement=rows, blocks=BLOCKS)
    assert control.recompute_ms_per_token == pytest.approx((0.02,) * 4)


@pytest.mark.parametrize("gbps", [1e6, 5e-7])
def test_a_bandwidth_outside_the_range_moves_only_by_evidence(gbps: float) -> None:
    """Review of session 80: the new clamp pulled a hello's bandwidth (1e6 GB/s, a test's "fast
    link"; or 5e-7) into ``GBPS_RANGE`` on a step that moved nothing over the link. It stays;
    the compute learns."""
    t = ProfileTracker(Profile(COMP), gbps, BLOCK_BYTES)
    rows = [(1, 1, 1, 1)] * 2
    t.update(ewma_factor=0.5, observed_step_ms=12.0, predicted_step_ms=6.0, placement=rows, blocks=BLOCKS)
    assert t.h2d_gbps == gbps and t.layer_compute_ms == pytest.approx(tuple(1.5 * c for c in COMP))
