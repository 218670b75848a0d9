"""TokenWriteback: the launch's indices address the parked rows and the tokens' host rows, and a
forward that ends before its last parked layer still writes back what it parked at the layers it
reached (control: without that, the host copy stays stale)."""

import numpy as np
import pytest
import torch

from sglang_ext.dataplane.layer_pipeline import LayerPipeline
from sglang_ext.dataplane.token_writeback import TokenWriteback
from tests.dataplane.core_driver import make_core, two_offloading


def test_plan_indexes_the_buffer_and_the_host_rows():
    """Three tokens, layers 0 and 2 of four host-only for tokens 0 and 2, layer 2 for token 1:
    sources are buffer rows (slot, K/V, token), destinations the block-first pool's token rows
    ``((p * L + l) * 2 + kv) * ps + off``; slots number the parked layers in order."""
    u_host = np.array([[1, 0, 1], [0, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=bool)
    pages, offs, ps, L, m = np.array([5, 9, 2]), np.array([3, 0, 7]), 8, 4, 3
    made = []
    it, idx = TokenWriteback.plan(u_host, pages, offs, ps, 100,
                                  lambda s, n: made.append((s, n)) or torch.zeros((s, 2, n, 1, 2)))
    assert made == [] and it.buf is None  # allocated with the step's device half, not at the plan
    it.allocate()
    it.allocate()
    assert made == [(2, 3)] and it.slots == (0, -1, 1, -1) and it.pairs == 5 and it.tokens == m
    assert (it.launch.layer, it.launch.trigger, it.launch.offset, it.launch.segments) == (2, 2, 100, 10)
    pairs = [(0, 0), (0, 2), (2, 0), (2, 1), (2, 2)]  # (layer, token), layer-major
    slot = {0: 0, 2: 1}
    src_k = [slot[layer] * 2 * m + j for layer, j in pairs]
    dst_k = [((pages[j] * L + layer) * 2) * ps + offs[j] for layer, j in pairs]
    assert idx.tolist() == src_k + [s + m for s in src_k] + dst_k + [d + ps for d in dst_k]
    assert TokenWriteback.plan(np.zeros((4, 3), dtype=bool), pages, offs, ps, 0, torch.zeros) is None


def test_a_plan_like_the_last_reuses_its_slots_only_where_the_places_match():
    """Random host-only places over steps: a plan given the last step's (``like``) equals a fresh
    plan (slots, launch, pairs and every index), reusing the last one's sources and memo exactly
    when ``u_host`` is the same (the usual steady step); a moved place plans afresh (the control
    below: reusing across moved places gives other indices)."""
    rng = np.random.default_rng(3)
    ps, L, m = 16, 6, 5
    u_host = rng.random((L, m)) < 0.3
    last, reused, moved = None, 0, 0
    for step in range(60):
        if step % 4 == 3:  # a placement moved some (layer, token) places
            u_host = u_host ^ (rng.random((L, m)) < 0.2)
            moved += 1
        pages, offs = rng.integers(0, 50, m), rng.integers(0, ps, m)
        fresh = TokenWriteback.plan(u_host, pages, offs, ps, 7, torch.zeros)
        got = TokenWriteback.plan(u_host, pages, offs, ps, 7, torch.zeros, like=last)
        assert (got is None) == (fresh is None)
        if got is None:
            last = None
            continue
        assert got[0] == fresh[0] and np.array_equal(got[1], fresh[1]), step
        if last is not None and np.array_equal(last.places[0], u_host):
            assert got[0].places is last.places and got[0].memo is last.memo
            reused += 1
        else:
            assert last is None or got[0].memo is not last.memo
        last = got[0]
    assert reused > 20 and moved > 10


def test_negative_control_a_reuse_across_moved_places_gives_other_indices():
    """The last step parked layer 0 of token 0 only; this one also layer 1 of token 1: reusing
    the last one's sources (what ``like`` does when the places match) writes other indices than
    the plan of this step's places."""
    pages, offs = np.array([4, 8]), np.array([1, 2])
    old = np.array([[1, 0], [0, 0]], dtype=bool)
    new = np.array([[1, 0], [0, 1]], dtype=bool)
    last, _ = TokenWriteback.plan(old, pages, offs, 16, 0, torch.zeros)
    right = TokenWriteback.plan(new, pages, offs, 16, 0, torch.zeros, like=last)
    stale = TokenWriteback.plan(old, pages, offs, 16, 0, torch.zeros, like=last)  # what a blind reuse gives
    assert right[0].pairs == 2 and stale[0].pairs == 1
    assert not np.array_equal(right[1], stale[1])


def test_park_copies_only_parked_layers():
    it, _ = TokenWriteback.plan(np.array([[0, 0], [1, 1]], dtype=bool), np.array([1, 2]), np.array([0, 1]), 4, 0,
                                lambda s, n: torch.zeros((s, 2, n, 1, 3)))
    k, v = torch.ones(2, 1, 3), torch.full((2, 1, 3), 2.0)
    it.allocate()  # as the step's device half does at its boundary
    it.park(0, k, v)
    assert it.buf.abs().sum() == 0
    it.park(1, k, v)
    assert torch.equal(it.buf[0, 0], k) and torch.equal(it.buf[0, 1], v)
    assert it.src_rows().shape == (4, 3)


@pytest.mark.parametrize("mended", [True, False])
def test_a_forward_that_ends_early_writes_back_what_it_parked(monkeypatch, mended):
    """Layers 0 and 2 offloaded (of 3): a decode forward that ends after layer 0 (SGLang's next
    forward begins) leaves layer 0's new tokens in host memory; layer 2, never run, is not
    written. Control: without the end-of-step write-back the host rows keep what was there."""
    if not mended:
        monkeypatch.setattr(LayerPipeline, "_write_back_reached", lambda self, tables: None)
    core = make_core(33 + 20)
    d = two_offloading(core)
    d.step([("a", 1), ("b", 1)])
    news = [d._grow(rid, 1) for rid in ("a", "b")]
    loc = torch.tensor([s for new in news for s in new])
    core.prepare_step([(rid, torch.tensor(d.slots[rid])) for rid in ("a", "b")], loc, [1, 1])
    parked = core.tables.token_writeback
    assert parked is not None and parked.slots[0] >= 0 and parked.slots[2] >= 0
    shape = (2, core.config.kv_heads, core.config.head_dim)
    k, v = torch.randn(shape), torch.randn(shape)
    core.enter_layer(0)
    core.write(0, loc, k, v)
    core.exit_layer(0)
    rows_before = core.store.engine.stats.d2h_rows
    core.pipeline.end_step()  # the forward ends here
    assert core.store.engine.stats.d2h_rows - rows_before == (2 * 2 if mended else 0)  # layer 0 only
    got_k, got_v = core.read_kv(0, loc)
    same = torch.equal(got_k, k) and torch.equal(got_v, v)
    assert same is mended
