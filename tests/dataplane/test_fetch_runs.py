"""A placed step's fetches as the copy engines take them: strided runs, not one copy per page.

Under ``--kv-copy-engine dma`` the host cost is per driver descriptor (1.2-2 us each on an H100,
``kernels/pitched_memcpy.py``), so a layer's fetch must come out as a few strided runs: a
request's consecutive host pages (2L rows apart in the block-first pool) into consecutive
staging pages. That holds because the staging room hands pages out ascending
(:meth:`StagingRoom.take`); the allocator's stack alone hands them out descending, one run per
page (the negative control).
"""

from __future__ import annotations

import numpy as np
import pytest

from kernels.pitched_memcpy import strided_runs
from sglang_ext.dataplane.staging_room import StagingRoom
from sglang_ext.tools.gpu_check_batch import CheckBatch
from sglang_ext.tools.gpu_check_config import SMALL

CONFIG = SMALL.with_overrides(layers=8, requests=6, context_min=256, context_max=1024)


def _placed_step_runs() -> tuple[int, int, int]:
    """(segments, runs, requests x offloaded layers) of one steady decode step of a batch whose
    last half of the layers is offloaded for every request."""
    batch = CheckBatch(CONFIG, "cpu")
    half = CONFIG.layers // 2
    batch.place([[1] * half + [0] * half for _ in batch.rids])
    engine, specs = batch.core.store.engine, []
    real = engine.fetch_pages

    def fetch_pages(spec, wait=()):  # noqa: ANN001, ANN202
        specs.append(spec)
        return real(spec, wait)

    engine.fetch_pages = fetch_pages
    for _ in range(3):  # the first step builds; the next ones run on advanced tables
        specs.clear()
        batch.begin_decode()
        staging = np.sort(batch.core.tables.staging_ids)
        for layer in range(CONFIG.layers):
            batch.core.enter_layer(layer)
            batch.core.exit_layer(layer)
    segments = runs = 0
    for spec in specs:
        src, dst = spec.indices()
        segments += src.size
        runs += strided_runs(src, dst, engine.host_page_rows, 1)[2].size
    chunks = 1 + int((np.diff(staging) != 1).sum())  # stretches of consecutive free device pages
    return segments, runs, (CONFIG.layers - half) * (CONFIG.requests + chunks)


def test_a_placed_steps_fetch_is_a_run_per_request_layer_and_half(monkeypatch):
    """Every layer-page of the offloaded half is fetched, as strided runs that break only where a
    request ends or the staging pages' free stretch does: at most 2 x layers x (requests +
    stretches) descriptors (K and V; ~90 here) for ~2,000 segments. Negative control: staging
    pages in the allocator's descending order give one run per segment."""
    segments, runs, bound = _placed_step_runs()
    assert segments > 10 * bound  # each request's offloaded pages, K and V
    assert runs <= 2 * bound, (runs, bound, segments)
    real = StagingRoom.take
    monkeypatch.setattr(StagingRoom, "take", lambda self, n: None if (ids := real(self, n)) is None else ids[::-1].copy())
    segments, runs, _ = _placed_step_runs()
    assert runs == segments, (runs, segments)


def test_the_staging_room_hands_pages_out_ascending():
    """``StagingRoom.take`` returns ascending ids (whatever order the allocator's stack pops)."""
    batch = CheckBatch(CONFIG.with_overrides(requests=2, context_max=256), "cpu")
    room = batch.core.room
    ids = room.take(40)
    assert ids is not None and np.all(np.diff(ids) > 0)
    room.give_back(ids)
    again = room.take(17)
    assert again is not None and np.all(np.diff(again) > 0)
    room.give_back(again)
    with pytest.raises(ValueError):  # the same ids twice: the allocator refuses (nothing lent twice)
        room.give_back(again)


def _boundary_moves(monkeypatch: pytest.MonkeyPatch | None = None) -> list[tuple[str, int, int]]:
    """(kind, segments, strided runs) of each copy of a plan that offloads every layer of one
    request (its dirty prefill written back) and of the plan that takes them back."""
    batch = CheckBatch(CONFIG.with_overrides(requests=2), "cpu")
    engine, seen = batch.core.store.engine, []
    real = engine._launch

    def launch(kind, src, dst, src_idx, dst_idx, wait, host_idx, keep=()):  # noqa: ANN001, ANN202
        steps = (engine.host_page_rows, 1) if kind == "h2d" else (1, engine.host_page_rows)
        seen.append((kind, host_idx[0].size, strided_runs(*host_idx, *steps)[2].size))
        return real(kind, src, dst, src_idx, dst_idx, wait, host_idx, keep)

    engine._launch = launch
    layers = CONFIG.layers
    batch.place([[0] * layers, [1] * layers])
    batch.place([[1] * layers, [1] * layers])
    return seen


def test_a_plans_moves_are_strided_runs_per_layer(monkeypatch):
    """A plan's offload writes back a request's pages at every layer and the next plan onloads
    them: each copy is ~2 runs per layer (K, V), not one per segment, because device pages are
    taken ascending for consecutive pages (``SlotKVStore.onload``). Negative control: the
    allocator's own (descending) order gives the onload one run per segment."""
    moves = _boundary_moves()
    assert [kind for kind, _, _ in moves] == ["d2h", "h2d"], moves
    for _, segments, runs in moves:
        assert segments > 20 * CONFIG.layers and runs <= 2 * 2 * CONFIG.layers, moves
    from sglang_ext.dataplane import slot_kv_store

    monkeypatch.setattr(slot_kv_store, "ascending", lambda ids: ids)  # the allocator's own order
    moves = _boundary_moves()
    assert [runs == segments for _, segments, runs in moves] == [False, True], moves  # the onload's pages
