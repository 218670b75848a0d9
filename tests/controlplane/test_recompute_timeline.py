"""The exact timeline and memory accounting with the recompute option (issue 16,
docs/recompute.md) on hand-worked cases; each equality has a negative control."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.model import (
    fetch_sizes,
    gpu_blocks,
    memory_blocks,
    recompute_compute_ms,
    request_staging_blocks,
    step_time_ms,
    transient_blocks,
)


def test_pure_recompute_adds_compute_and_fetches_nothing():
    """k = L: the prefix joins every layer's compute, nothing is fetched.

    L=2, comp [1, 1] ms, block_size 2, rms [0.5, 0.25] ms/token, b=3, all layers resident,
    u=2 (4 tokens), k=2: layer 0 runs 1 + 4*0.5 = 3 ms, layer 1 1 + 4*0.25 = 2 ms -> 5 ms.
    Memory: resident (3-2)*2 = 2, staging 0 (no fetch), transient 2.
    """
    kw = {"recompute": [(2, 2)], "recompute_ms_per_token": [0.5, 0.25], "block_size": 2}
    assert step_time_ms([[1, 1]], [3], [1.0, 1.0], 1.0, **kw) == pytest.approx(5.0)
    assert recompute_compute_ms([1.0, 1.0], [(2, 2)], [0.5, 0.25], 2) == [3.0, 2.0]
    assert memory_blocks([[1, 1]], [3], [(2, 2)]) == (2, 0)
    assert transient_blocks([(2, 2)]) == 2
    assert gpu_blocks([[1, 1]], [3], [(2, 2)]) == 4
    # negative control: the same placement without recompute computes 2 ms and holds 6 blocks
    assert step_time_ms([[1, 1]], [3], [1.0, 1.0], 1.0) == pytest.approx(2.0)
    assert gpu_blocks([[1, 1]], [3]) == 6


def test_pure_prefix_fetch_goes_through_the_slot_layer_by_layer():
    """k = 0: the prefix is fetched for every layer like an offloaded layer of u blocks.

    L=3, comp 1 ms each, bw 1 block/ms, b=4, all resident, u=2, k=0: f = [2, 2, 2].
    Fetch 0: 0-2, layer 0 runs 2-3; the slot frees at 3, fetch 1: 3-5, layer 1 5-6;
    fetch 2: 6-8, layer 2 8-9 -> 9 ms. Memory: resident (4-2)*3 = 6, staging 2, transient 0.
    """
    kw = {"recompute": [(2, 0)], "recompute_ms_per_token": [5.0] * 3, "block_size": 1}
    assert fetch_sizes([1, 1, 1], 4, 2, 0) == [2, 2, 2]
    assert step_time_ms([[1, 1, 1]], [4], [1.0] * 3, 1.0, **kw) == pytest.approx(9.0)
    assert memory_blocks([[1, 1, 1]], [4], [(2, 0)]) == (6, 2)
    assert transient_blocks([(2, 0)]) == 0
    # negative control: fetching the whole request per layer (b=4, all offloaded) is slower
    assert step_time_ms([[0, 0, 0]], [4], [1.0] * 3, 1.0) == pytest.approx(15.0)


def test_mixed_k_overlaps_the_prefix_fetch_with_recompute():
    """0 < k < L: layers < k recompute while the fetch for layer k is in flight.

    L=4, comp 1 ms, bs 1, rms 0.5 ms/token, bw 1 block/ms, b=3 all resident, u=2, k=2.
    Layers 0-1 run 1 + 2*0.5 = 2 ms each (0-2, 2-4); the prefix of layer 2 (2 blocks) is
    fetched 0-2 underneath, so layer 2 runs 4-5 with no stall; the slot frees at 5, layer 3's
    fetch runs 5-7, layer 3 runs 7-8 -> 8 ms. Memory: resident 1*4, staging 2, transient 2.
    """
    kw = {"recompute": [(2, 2)], "recompute_ms_per_token": [0.5] * 4, "block_size": 1}
    assert fetch_sizes([1] * 4, 3, 2, 2) == [0, 0, 2, 2]
    t = step_time_ms([[1] * 4], [3], [1.0] * 4, 1.0, **kw)
    assert t == pytest.approx(8.0)
    assert gpu_blocks([[1] * 4], [3], [(2, 2)]) == 4 + 2 + 2
    # negative control: recompute then fetch in sequence, without overlap, would be 6 + 4 = 10
    assert t != pytest.approx(6.0 + 4.0)


def test_prefix_and_cached_blocks_share_one_slot():
    """An offloaded layer >= k fetches its cached blocks and the prefix together.

    L=3, comp 1 ms, bs 1, rms 1 ms/token, bw 1, b=4, layer 2 offloaded, u=1, k=1:
    f = [0, 1, 3 + 1]. Layer 0 runs 1 + 1 = 2 ms (0-2); fetch 1 (1 block) 0-1; layer 1 2-3;
    fetch 2 (4 blocks) 3-7; layer 2 7-8 -> 8 ms. Memory: resident 3*2, staging max f = 4,
    transient 1.
    """
    kw = {"recompute": [(1, 1)], "recompute_ms_per_token": [1.0] * 3, "block_size": 1}
    assert fetch_sizes([1, 1, 0], 4, 1, 1) == [0, 1, 4]
    assert step_time_ms([[1, 1, 0]], [4], [1.0] * 3, 1.0, **kw) == pytest.approx(8.0)
    assert memory_blocks([[1, 1, 0]], [4], [(1, 1)]) == (6, 4)
    assert gpu_blocks([[1, 1, 0]], [4], [(1, 1)]) == 11
    # negative control: with k=3 the prefix is recomputed in every layer, so the slot holds only
    # the 3 cached blocks, not b = 4
    assert memory_blocks([[1, 1, 0]], [4], [(1, 3)]) == (6, 3)


def test_slot_holds_the_cached_and_prefix_columns_fetched_in_different_layers():
    """The staging slot is the union of the columns fetched in some layer (the served core's
    reservation, docs/recompute.md "Memory"), not the largest single-layer fetch.

    L=3, b=4, layer 0 offloaded, u=1, k=2: f = [3, 0, 1] (layer 0 fetches the 3 cached blocks,
    layer 2 the 1 prefix block). Both sets of columns are fetched, so the slot holds 3 + 1 = 4
    (the largest fetch is only 3). Resident 3 * 2 = 6, transient 1 -> 11.
    """
    assert fetch_sizes([0, 1, 1], 4, 1, 2) == [3, 0, 1]
    assert request_staging_blocks([0, 1, 1], 4, 1, 2) == 4
    assert memory_blocks([[0, 1, 1]], [4], [(1, 2)]) == (6, 4)
    assert gpu_blocks([[0, 1, 1]], [4], [(1, 2)]) == 11
    # negative control: the largest per-layer fetch (the rule before) is one block short
    assert max(fetch_sizes([0, 1, 1], 4, 1, 2)) == 3 != memory_blocks([[0, 1, 1]], [4], [(1, 2)])[1]
    # k = L: the prefix is never fetched, the slot holds the cached columns only
    assert request_staging_blocks([0, 1, 1], 4, 1, 3) == 3
    # nothing offloaded, k < L: the slot holds the prefix only; k = L: no slot
    assert request_staging_blocks([1, 1, 1], 4, 1, 2) == 1
    assert request_staging_blocks([1, 1, 1], 4, 1, 3) == 0


def test_partial_fetches_share_the_link():
    """Fetches of different sizes share the bandwidth (processor sharing).

    L=2, comp 1 ms, bw 1 block/ms. r0: b=2 resident, u=1, k=0 (f = [1, 1]); r1: b=2, layer 0
    offloaded (f = [2, 0]). Both fetch for layer 0 at 0.5 block/ms: r0 lands at 2, r1's last
    block at 1/ms lands at 3; layer 0 runs 3-4; r0's fetch for layer 1 runs 4-5; layer 1 5-6.
    Memory: r0 1*2 + 1, r1 2*1 + 2.
    """
    kw = {"recompute": [(1, 0), (0, 0)], "recompute_ms_per_token": [1.0, 1.0], "block_size": 1}
    rows = [[1, 1], [0, 1]]
    assert step_time_ms(rows, [2, 2], [1.0, 1.0], 1.0, **kw) == pytest.approx(6.0)
    assert gpu_blocks(rows, [2, 2], [(1, 0), (0, 0)]) == 3 + 4
    # negative control: without r0's prefix fetch, r1 alone lands at 2 -> 4 ms
    assert step_time_ms(rows, [2, 2], [1.0, 1.0], 1.0) == pytest.approx(4.0)


def test_u_zero_is_the_old_model_exactly():
    """(0, k) for every request is the model without recompute (k ignored), bit for bit."""
    rows = [[1, 0, 1], [0, 0, 1], [1, 1, 1]]
    blocks, comp = [3, 5, 2], [0.7, 1.3, 0.4]
    old = step_time_ms(rows, blocks, comp, 2.5)
    new = step_time_ms(rows, blocks, comp, 2.5, recompute=[(0, 0), (0, 3), (0, 1)])
    assert new == old
    assert memory_blocks(rows, blocks, [(0, 2)] * 3) == memory_blocks(rows, blocks)
    # negative control: one recomputed block changes the answer
    assert step_time_ms(
        rows, blocks, comp, 2.5, recompute=[(1, 0), (0, 0), (0, 0)]
    ) != pytest.approx(old)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(1, 4), layers=st.integers(1, 6))
def test_u_zero_identity_on_random_placements(data, n, layers):
    """Random placements: recompute (0, k) equals the old timeline and memory exactly."""
    rows = data.draw(st.lists(st.lists(st.integers(0, 1), min_size=layers, max_size=layers), min_size=n, max_size=n))
    blocks = data.draw(st.lists(st.integers(1, 20), min_size=n, max_size=n))
    comp = data.draw(st.lists(st.floats(0.0, 3.0), min_size=layers, max_size=layers))
    bw = data.draw(st.floats(0.1, 30.0))
    ks = data.draw(st.lists(st.integers(0, layers), min_size=n, max_size=n))
    rec = [(0, k) for k in ks]
    assert step_time_ms(rows, blocks, comp, bw, recompute=rec) == step_time_ms(rows, blocks, comp, bw)
    assert memory_blocks(rows, blocks, rec) == memory_blocks(rows, blocks)
    assert transient_blocks(rec) == 0


def test_out_of_range_recompute_is_refused():
    """u beyond b - 1, k beyond L, or a recompute without its per-token cost raise ValueError."""
    with pytest.raises(ValueError, match=r"u=3 is out of range \(allowed \[0, 2\]\)"):
        step_time_ms([[1, 1]], [3], [1.0, 1.0], 1.0, recompute=[(3, 1)], recompute_ms_per_token=[1, 1])
    with pytest.raises(ValueError, match=r"k=3 is out of range \(allowed \[0, 2\]\)"):
        memory_blocks([[1, 1]], [3], [(1, 3)])
    with pytest.raises(ValueError, match="recompute_ms_per_token is required"):
        step_time_ms([[1, 1]], [3], [1.0, 1.0], 1.0, recompute=[(1, 1)])
    with pytest.raises(ValueError, match="entries"):
        memory_blocks([[1, 1]], [3], [(1, 1), (0, 0)])
    # negative control: the same call in range works
    assert step_time_ms([[1, 1]], [3], [1.0, 1.0], 1.0, recompute=[(2, 2)], recompute_ms_per_token=[1, 1]) == 6.0
