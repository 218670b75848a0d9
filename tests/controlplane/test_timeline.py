"""The exact placement model (issue 2 §2) on hand-worked cases."""

import pytest

from controlplane.model import memory_blocks, step_time_ms


def test_all_on_gpu_is_sum_of_compute():
    """With nothing offloaded the step is exactly the sum of layer compute."""
    assert step_time_ms([[1, 1, 1], [1, 1, 1]], [5, 9], [1.0, 2.0, 3.0], 1.0) == 6.0


def test_one_request_hidden_transfer():
    """A transfer shorter than the preceding layers' compute causes no stall.

    b=2 blocks at 1 block/ms: layer 3's fetch starts at t=0, lands at 2, layers 1-2 end at 2.
    """
    assert step_time_ms([[1, 1, 0]], [2], [1.0, 1.0, 1.0], 1.0) == pytest.approx(3.0)


def test_stall_on_layer_one():
    """Offloading layer 1 stalls the step start by the whole transfer: 6 blocks at 3/ms = 2 ms."""
    assert step_time_ms([[0, 1, 1]], [6], [1.0, 1.0, 1.0], 3.0) == pytest.approx(5.0)


def test_one_request_middle_layer_stall():
    """b=6 at 3 blocks/ms for layer 2: lands at 2, layer 1 ends at 1 -> stall 1 ms, total 4."""
    assert step_time_ms([[1, 0, 1]], [6], [1.0, 1.0, 1.0], 3.0) == pytest.approx(4.0)


def test_two_requests_share_bandwidth():
    """Two concurrent fetches share bandwidth equally, the survivor speeds up after the first ends.

    b=(2, 4), bw=2/ms, both offload layer 2, comp 1 ms each.  Both streams get 1 block/ms: r0 lands
    at t=2 (2 blocks), r1 has 2 left and gets 2/ms -> lands at t=3.  Layer 2 runs 3-4, layer 3 4-5.
    """
    assert step_time_ms([[1, 0, 1], [1, 0, 1]], [2, 4], [1.0, 1.0, 1.0], 2.0) == pytest.approx(5.0)


def test_slot_reuse_waits_for_layer_end():
    """A request's second fetch starts only when the layer that used its slot has ended.

    b=1, bw=1/ms, offload layers 1 and 2, comp 1 ms.  Fetch L1: 0-1, L1 runs 1-2, fetch L2 starts at
    2 (slot busy until L1 ends), lands at 3, L2 runs 3-4, L3 4-5.
    """
    assert step_time_ms([[0, 0, 1]], [1], [1.0, 1.0, 1.0], 1.0) == pytest.approx(5.0)


def test_prefetch_overlaps_across_layers():
    """A fetch started at t=0 for a deep layer overlaps with all earlier layers' compute."""
    # b=3 at 1 block/ms, layer 4 offloaded; layers 1-3 take 3 ms: perfect overlap.
    assert step_time_ms([[1, 1, 1, 0]], [3], [1.0] * 4, 1.0) == pytest.approx(4.0)
    # b=5: lands at 5, layer 3 ended at 3 -> 2 ms stall.
    assert step_time_ms([[1, 1, 1, 0]], [5], [1.0] * 4, 1.0) == pytest.approx(6.0)


def test_paper_fig3_placement_a_stalls():
    """OrbitFlow Fig. 3 flavour: 9 layers, bandwidth 3 blocks per layer-time, uniform distance 3.

    Requests of 3 and 6 blocks, layers 3/6/9 offloaded for both.  First fetches (3 and 6 blocks)
    share 3/ms: r0 lands at 2, r1 at 3; layer 3 starts at 3 (stall 1).  Slots free at 4; next fetches
    take again 3 ms (r1 lands at 7 > layer-5 end 6 -> stall 1), and the same at layer 9.
    """
    x = [[1, 1, 0] * 3, [1, 1, 0] * 3]
    assert step_time_ms(x, [3, 6], [1.0] * 9, 3.0) == pytest.approx(12.0)


def test_memory_accounting():
    """Resident counts kept layers; staging is one layer per request that offloads anything."""
    resident, staging = memory_blocks([[1, 0, 1], [1, 1, 1], [0, 0, 0]], [2, 3, 5])
    assert resident == 2 * 2 + 3 * 3 + 0
    assert staging == 2 + 5


def test_shape_errors_are_clear():
    """Mismatched shapes raise ValueError naming the problem."""
    with pytest.raises(ValueError, match="rows"):
        step_time_ms([[1]], [1, 2], [1.0], 1.0)
    with pytest.raises(ValueError, match="layers"):
        step_time_ms([[1, 0]], [1], [1.0], 1.0)


def test_fetch_launches_delay_the_next_layer_and_transfers_keep_moving():
    """launch_ms: one launch per target layer at the step start and at each layer end; the next
    layer starts that much later while transfers in flight keep moving (module docstring)."""
    # one request, layers 1 and 2 offloaded, 2 blocks at 1 block/ms, comp 1 ms, launch 0.5:
    # t=0 launch of layer 1's fetch (0.5) -> layer 0 runs 0.5..1.5 (fetch done at 2.0) -> stall
    # to 2.0, layer 1 runs 2.0..3.0 -> its slot frees, layer 2's fetch starts at 3.0, launch to
    # 3.5 -> fetch done at 5.0, layer 2 runs 5.0..6.0
    assert step_time_ms([[1, 0, 0]], [2], [1.0] * 3, 1.0, launch_ms=0.5) == pytest.approx(6.0)
    # ... the same step without launch cost: the launches ran while the layers waited on transfers
    assert step_time_ms([[1, 0, 0]], [2], [1.0] * 3, 1.0) == pytest.approx(6.0)
    # a launch the transfer does not cover shows: 1 block, so layer 1's fetch lands at 1.0 < 1.5
    assert step_time_ms([[1, 0, 0]], [1], [1.0] * 3, 1.0, launch_ms=0.5) == pytest.approx(4.5)
    assert step_time_ms([[1, 0, 0]], [1], [1.0] * 3, 1.0) == pytest.approx(4.0)
    # a hidden fetch: the launch time is all that is left of it
    assert step_time_ms([[1, 1, 0]], [1], [1.0] * 3, 1.0, launch_ms=0.25) == pytest.approx(3.25)
    # two requests fetching the same layer at the same trigger share one launch; different layers
    # are two launches
    same = step_time_ms([[1, 1, 0], [1, 1, 0]], [1, 1], [1.0] * 3, 4.0, launch_ms=0.25)
    apart = step_time_ms([[1, 1, 0], [1, 0, 1]], [1, 1], [1.0] * 3, 4.0, launch_ms=0.25)
    assert same == pytest.approx(3.25)
    assert apart == pytest.approx(3.5)
    # nothing offloaded: no launch
    assert step_time_ms([[1, 1, 1]], [4], [1.0] * 3, 1.0, launch_ms=9.0) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="launch_ms"):
        step_time_ms([[1, 0, 1]], [4], [1.0] * 3, 1.0, launch_ms=-1.0)


def test_launch_count_is_what_the_timeline_charges():
    """launch_count: distinct first offloaded layers + per trigger the distinct next layers; with
    every transfer instant (huge bandwidth) the timeline adds exactly launch_count x launch_ms."""
    from controlplane.model import launch_count

    cases = [
        ([[1, 1, 1]], 0),
        ([[1, 0, 0]], 2),
        ([[1, 1, 0], [1, 1, 0]], 1),
        ([[1, 1, 0], [1, 0, 1]], 2),
        # firsts {0, 1}; triggers 0: {2, 1}, 1: {3}, 2: {3}
        ([[0, 1, 0, 0], [1, 0, 1, 0], [0, 0, 1, 1]], 6),
    ]
    for rows, want in cases:
        assert launch_count(rows) == want
        blocks = [3] * len(rows)
        comp = [1.0] * len(rows[0])
        free = step_time_ms(rows, blocks, comp, 1e12)
        assert step_time_ms(rows, blocks, comp, 1e12, launch_ms=0.5) == pytest.approx(free + 0.5 * want)
