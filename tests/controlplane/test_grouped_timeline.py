"""The grouped timeline (``controlplane/model/grouped_timeline.py``) against the event heap it
replaced in ``step_time_ms`` (``fetch_timeline_ms``, kept as the reference): equal to float
rounding on random placements (repeated rows, recompute, fetch launches, cutoffs), with negative
controls; and grouped work: a batch's repeated rows are one group whatever the batch size."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.model import fetch_sizes, fetch_timeline_ms, recompute_compute_ms, step_time_ms
from controlplane.model.grouped_timeline import fetch_groups, grouped_timeline_ms, placement_groups


def heap_step_ms(placement, blocks, comp, bw, recompute=None, rms=None, block_size=1, launch_ms=0.0,
                 cutoff=math.inf):
    """``step_time_ms`` as it was: per-request fetches through the event heap."""
    comp = list(comp)
    fetches = []
    if recompute is not None and any(u and k for u, k in recompute):
        comp = recompute_compute_ms(comp, recompute, rms, block_size)
    for r, (row, b) in enumerate(zip(placement, blocks, strict=True)):
        u, k = recompute[r] if recompute is not None else (0, 0)
        fetches.append([(layer, f) for layer, f in enumerate(fetch_sizes(row, b, u, k)) if f > 0])
    return fetch_timeline_ms(fetches, comp, bw, launch_ms=launch_ms, cutoff=cutoff)


@st.composite
def batches(draw):
    layers = draw(st.integers(1, 12))
    rows = st.tuples(*[st.integers(0, 1)] * layers)
    pool = draw(st.lists(rows, min_size=1, max_size=3))  # rows repeat, as a plan's do
    n = draw(st.integers(1, 8))
    placement = [draw(st.sampled_from(pool) | rows) for _ in range(n)]
    blocks = [draw(st.sampled_from([7, 7, 1]) | st.integers(1, 60)) for _ in range(n)]
    comp = [draw(st.sampled_from([0.0]) | st.floats(0.01, 2.0)) for _ in range(layers)]
    bw = draw(st.floats(0.5, 50.0))
    launch = draw(st.sampled_from([0.0]) | st.floats(0.0, 0.3))
    recompute = rms = None
    if draw(st.booleans()):
        recompute = [(draw(st.integers(0, b - 1)), draw(st.integers(0, layers))) for b in blocks]
        rms = [draw(st.floats(0.0, 0.01)) for _ in range(layers)]
    return placement, blocks, comp, bw, launch, recompute, rms


@settings(max_examples=400, deadline=None)
@given(batches())
def test_the_grouped_step_equals_the_event_heap(case):
    """The grouped timeline, and ``step_time_ms`` (grouped or heap by the fetches per layer),
    equal the event heap on the same placement."""
    placement, blocks, comp, bw, launch, recompute, rms = case
    want = heap_step_ms(placement, blocks, comp, bw, recompute, rms, 4, launch)
    kw = dict(recompute=recompute, recompute_ms_per_token=rms, block_size=4, launch_ms=launch)
    assert step_time_ms(placement, blocks, comp, bw, **kw) == pytest.approx(want, rel=1e-9)
    if recompute is None:
        groups = placement_groups(placement, blocks)
        got = grouped_timeline_ms(groups, comp, bw, launch_ms=launch)
    else:
        fetches = [[(layer, f) for layer, f in enumerate(fetch_sizes(row, b, u, k)) if f > 0]
                   for row, b, (u, k) in zip(placement, blocks, recompute, strict=True)]
        got = grouped_timeline_ms(fetch_groups(fetches), recompute_compute_ms(comp, recompute, rms, 4), bw,
                                  launch_ms=launch)
    assert got == pytest.approx(want, rel=1e-9)


@settings(max_examples=200, deadline=None)
@given(batches(), st.floats(0.2, 1.2))
def test_a_cutoff_stops_both_at_the_same_steps(case, frac):
    """With a cutoff, both return ``inf`` on the same inputs and the same time otherwise."""
    placement, blocks, comp, bw, launch, recompute, rms = case
    full = heap_step_ms(placement, blocks, comp, bw, recompute, rms, 4, launch)
    cut = full * frac
    fetches = []
    for r, (row, b) in enumerate(zip(placement, blocks, strict=True)):
        u, k = recompute[r] if recompute is not None else (0, 0)
        fetches.append([(layer, f) for layer, f in enumerate(fetch_sizes(row, b, u, k)) if f > 0])
    c = recompute_compute_ms(comp, recompute, rms, 4) if recompute is not None else comp
    want = fetch_timeline_ms(fetches, c, bw, launch_ms=launch, cutoff=cut)
    got = grouped_timeline_ms(fetch_groups(fetches), c, bw, launch_ms=launch, cutoff=cut)
    assert (got == math.inf) == (want == math.inf)
    if want < math.inf:
        assert got == pytest.approx(want, rel=1e-9)


def test_negative_controls_the_comparison_sees_one_row_one_block_one_launch():
    """Negative controls: one changed row, one more block, or a launch cost the heap does not
    get changes the step beyond the tolerance the equality above uses."""
    placement = [(1, 0, 1, 0), (1, 0, 1, 0), (0, 1, 1, 0)]
    blocks, comp, bw = [8, 12, 5], [3.0] * 4, 4.0  # 17.75 ms: stalls, and launches cost
    base = heap_step_ms(placement, blocks, comp, bw)
    assert step_time_ms(placement, blocks, comp, bw) == pytest.approx(base, rel=1e-9)
    moved = [(1, 0, 1, 0), (0, 0, 1, 0), (0, 1, 1, 0)]
    assert step_time_ms(moved, blocks, comp, bw) != pytest.approx(base, rel=1e-9)
    assert step_time_ms(placement, [8, 13, 5], comp, bw) != pytest.approx(base, rel=1e-9)
    assert step_time_ms(placement, blocks, comp, bw, launch_ms=0.05) != pytest.approx(base, rel=1e-9)
    grouped = grouped_timeline_ms(placement_groups(placement, blocks), comp, bw)  # not the heap's path
    assert grouped == pytest.approx(base, rel=1e-9)
    assert grouped_timeline_ms(placement_groups(moved, blocks), comp, bw) != pytest.approx(base, rel=1e-9)
    assert grouped_timeline_ms(placement_groups(placement, [8, 13, 5]), comp, bw) != pytest.approx(base, rel=1e-9)
    assert grouped_timeline_ms(placement_groups(placement, blocks), comp, bw, launch_ms=0.05) != pytest.approx(
        base, rel=1e-9)


def test_repeated_rows_are_one_group_whatever_the_batch():
    """512 requests x 80 layers on four rows are four groups; a group's per-fetch sizes are one
    list (built once, not per layer), so building them is O(requests + groups x layers)."""
    layers = 80
    rows = [tuple(int(layer % m != 0) for layer in range(layers)) for m in (2, 3, 5)] + [(1,) * layers]
    placement = [rows[i % 4] for i in range(512)]
    blocks = [16 + i % 300 for i in range(512)]
    groups = placement_groups(placement, blocks)
    assert len(groups) == 3  # the all-GPU row fetches nothing
    for p, sizes in groups:
        assert len(sizes) == len(p) and all(s is sizes[0] for s in sizes)
        assert len(sizes[0]) == 128
    assert sorted(len(p) for p, _ in groups) == [16, 27, 40]


def test_requests_fetching_at_the_same_layers_share_a_group_with_their_own_sizes():
    """``fetch_groups`` keys on the fetch layers; each member keeps its sizes per fetch."""
    groups = dict(fetch_groups([[(1, 4), (3, 6)], [], [(1, 2), (3, 9)], [(0, 5)]]))
    assert groups == {(1, 3): [[4.0, 2.0], [6.0, 9.0]], (0,): [[5.0]]}
