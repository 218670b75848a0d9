"""The steady-decode fast path leaves the pool as the general path does; and the append fast path
vs the full reconciliation under a tiny budget, where the fast path once skipped the staging
reserve of an offloading request that grew."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.sglang.test_layered_pool import (
    DIM,
    HEADS,
    LAYERS,
    PAGE,
    RIDS,
    Harness,
    LayeredTokenToKVPool,
    apply_op,
    make_pool,
    op,
    wants,
)

pytestmark = pytest.mark.sglang


def test_append_fast_path_keeps_the_staging_reserve_of_a_grown_offloading_request():
    """Found by ``test_layered_pool.py``'s property test (2026-11-24; a strict xfail until session
    49): with a 6-page budget, b (every layer on host by the local fallback) grows from 2 to 4
    pages. It places nothing, but its staging slot grows to 4 pages, and with a's 3 resident
    layer-pages that is 7 > 6: the full pass's local fallback moves a's layers 2 and 1 to host.
    The append fast path used to return "nothing to place" there and kept a's layers; now it
    declines and the full pass runs. Control: a full pass without the local fallback keeps a's
    layers, and the comparison tells it apart."""
    ops = [("step", "a", 1, None, 0), ("step", "a", 1, None, 0), ("step", "b", 2, None, 0),
           ("step", "b", 2, None, 0), ("step", "b", 3, None, 0)]
    fast, full, control = (make_pool(budget_tokens=12) for _ in range(3))
    full.residency._reconcile_appended = lambda: None
    control.residency._reconcile_appended = lambda: None
    control.residency._flip_local_layer = lambda: False
    harnesses = [(Harness(pool), pool) for pool in (fast, full, control)]
    for item in ops:
        passes, eligible = fast.residency.full_reconciles, not fast.residency.changed
        for h, pool in harnesses:
            apply_op(pool, h, item)
    assert eligible  # nothing but appends since the last full pass: the fast path was asked
    assert fast.residency.full_reconciles == passes + 1  # and declined
    for h, _ in harnesses:
        h.check()
    assert fast.residency.gpu_layers("a") == (True, False, False)
    assert torch.equal(fast.store.resident_mask(), full.store.resident_mask())
    assert control.residency.gpu_layers("a") == (True, True, True)
    assert not torch.equal(fast.store.resident_mask(), control.store.resident_mask())


def _decode(pool: LayeredTokenToKVPool, h: Harness, rids: list[str], fast: bool) -> bool:
    """One decode step of ``rids`` (one new token each, in that order): the attention backend's
    steady-decode call when ``fast`` (general path if it declines), else the general path.
    Returns whether the fast path took the step."""
    new = [h._new_slots(rid, 1)[0] for rid in rids]
    loc = torch.tensor(new, dtype=torch.int64)
    lens = np.array([len(h.slots[rid]) for rid in rids], dtype=np.int64)
    took = fast and pool.prepare_decode_step(rids, lens, loc)
    if not took:
        pool.prepare_step([(rid, torch.tensor(h.slots[rid])) for rid in rids], loc)
    for layer in range(LAYERS):
        pool.enter_layer(layer)
        k = torch.randn((len(rids), HEADS, DIM), generator=h.gen).half()
        v = torch.randn((len(rids), HEADS, DIM), generator=h.gen).half()
        pool.set_kv_buffer(SimpleNamespace(layer_id=layer), loc, k, v)
        for i, slot in enumerate(new):
            h.shadow[(layer, slot)] = (k[i].clone(), v[i].clone())
        pool.exit_layer(layer)
    return took


decode_op = st.tuples(st.just("decode"), st.lists(st.sampled_from(RIDS), min_size=1, max_size=3, unique=True))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.one_of(op, decode_op, decode_op), min_size=1, max_size=30), budget=st.sampled_from([72, None]))
def test_steady_decode_fast_path_leaves_the_pool_as_the_general_path_does(ops, budget):
    """prepare_decode_step (the attention backend's steady-decode path) leaves residency, the
    device map, dirty and has-KV marks, each request's pages and every K/V exactly as
    prepare_step + readable_in_place would once its journal is applied -- and it declines
    (changing nothing) after anything but an append. In the paged layout (budget 72) the steady
    path starts from the last step's page lists and stages as the general path does: the same
    comparison holds step by step."""
    fast, full = make_pool(budget_tokens=budget), make_pool(budget_tokens=budget)
    hf, hs = Harness(fast, seed=1), Harness(full, seed=1)
    took = 0
    for item in ops:
        if item[0] == "decode":
            rids = [r for r in item[1] if r in hf.slots]
            if not rids or len(hf.free_pages) < len(rids):
                continue
            took += _decode(fast, hf, rids, fast=True)
            _decode(full, hs, rids, fast=False)
        else:
            for h, pool in ((hf, fast), (hs, full)):
                apply_op(pool, h, item)
        if any(entry[2] for entry in fast.residency.journal.entries):
            # journalled, not yet applied: the step itself placed nothing (negative control for
            # the comparison below, and proof that the bookkeeping left the step)
            assert not torch.equal(fast.store.map_cpu, full.store.map_cpu)
        fast.core.settle()  # what every reader of residency does first
        full.core.settle()  # (recorded releases and frees)
        assert not fast.residency.journal.entries
        assert torch.equal(fast.store.map_cpu, full.store.map_cpu)
        assert torch.equal(fast.store.dirty, full.store.dirty)
        assert torch.equal(fast.residency.has_kv, full.residency.has_kv)
        # cached vs recomputed counts (the fast path is not a staged step: nothing to stage);
        # copy and stall seconds are wall-clock measurements, equal only by chance
        untimed = {"staged_steps_total": 0, "h2d_seconds_total": 0.0, "d2h_seconds_total": 0.0,
                   "stall_seconds_total": 0.0, "journalled_decode_steps_total": 0,  # journalled: the fast one
                   "resident_builds_total": 0,  # which build a step took, not what it placed
                   "opened_one_pass_total": 0,  # which route placed the opened pages, not what it placed
                   "decode_turnovers_total": 0,  # which path a batch change took
                   "slot_handoffs_total": 0, "slot_readbacks_total": 0}  # how the fast path got its slots
        assert replace(fast.residency_stats(), **untimed) == replace(full.residency_stats(), **untimed)
        full.residency._live_stats = None
        assert fast.residency.live_rids() == full.residency.live_rids()
        for rid in fast.residency.live_rids():
            assert torch.equal(fast.residency.requests[rid].pages, full.residency.requests[rid].pages)
    if budget is not None:
        assert took == fast.core.paged_decode_steps  # the paged layout's steps took the paged path
    hf.check()
    hs.check()


def test_steady_decode_fast_path_takes_plain_decode_steps_and_declines_after_a_change():
    """Identity layout: a plain decode of known requests takes the fast path (new pages read in
    place; placed at every layer and dirty once the journal is applied, which the first reader of
    residency does); an offloading want changes nothing there (no host tier: it is kept on the
    device, and every page stays resident); a request the pool does not know yet declines it."""
    pool = make_pool(budget_tokens=None, page_size=PAGE)
    h = Harness(pool, in_place=True)
    h.step("a", 3)
    h.step("b", 2)
    assert _decode(pool, h, ["a", "b"], fast=True)
    pages = [s // PAGE for s in h.slots["a"] + h.slots["b"]]
    # the step only journalled its new page: not placed yet (the forward wrote and read in place)
    assert pool.residency.journal.entries
    assert not bool((pool.store.map_cpu[:, pages] >= 0).all())
    stats = pool.residency_stats()  # any reader of residency applies the journal first
    assert not pool.residency.journal.entries
    assert stats.live_layer_pages == LAYERS * len(set(pages))
    assert bool((pool.store.map_cpu[:, pages] >= 0).all())
    assert bool(pool.store.dirty[:, pages[-1]].all())
    pool.update_residency({"a": wants(pool, h, "a", (True, False, True))})
    assert _decode(pool, h, ["a", "b"], fast=True)
    pages = [s // PAGE for s in h.slots["a"] + h.slots["b"]]
    assert pool.residency_stats().live_layer_pages == LAYERS * len(set(pages))
    assert bool((pool.store.map_cpu[:, pages] >= 0).all())
    h.slots["c"] = []  # its first token's page: a request the pool has not seen
    assert not _decode(pool, h, ["a", "b", "c"], fast=True)
    h.check()
