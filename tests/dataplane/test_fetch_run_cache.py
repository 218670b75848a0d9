"""FetchRunCache: a step's fetch planned once per (requests, host-only pages), reused shifted.

Every fetch's plan from the cache expands to exactly the pairs :func:`plan_runs` makes from the
fetch's own segments (:meth:`PageFetch.indices`), whether it was planned or reused; it is reused
only where the layer's host-only pages of those requests are the planned layer's.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from kernels import pitched_memcpy
from kernels.block_copy import fetch_page_indices
from kernels.pitched_memcpy import plan_runs
from sglang_ext.dataplane import fetch_run_cache
from sglang_ext.dataplane.fetch_run_cache import FetchRunCache
from sglang_ext.dataplane.page_fetch import PageFetch

L, P = 8, 64
"""Layers and logical pages of the toy pool (host rows of page p at layer l: 2 (p L + l), +1)."""
DEV_V = 500


def _pairs(plan: tuple) -> tuple[np.ndarray, np.ndarray]:
    """Every (src, dst) pair of a plan, runs expanded, in plan order."""
    groups, rest_s, rest_d = plan
    src, dst = [], []
    for s0, d0, n, s_step, d_step in groups:
        k = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        src.append(np.repeat(s0, n) + k * np.repeat(np.broadcast_to(s_step, n.shape), n))
        dst.append(np.repeat(d0, n) + k * np.repeat(np.broadcast_to(d_step, n.shape), n))
    return np.concatenate([*src, rest_s]), np.concatenate([*dst, rest_d])


def _step(rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """One step's page lists: 6 requests of consecutive pages (some with a page elsewhere: a
    decode page), their staging pages ascending, and the map (:func:`_with_map`)."""
    counts = rng.integers(1, 9, size=6)
    lists = [np.arange(s, s + c) * 1 for s, c in zip(rng.choice(P - 9, size=6, replace=False), counts, strict=True)]
    for pages in lists:
        if rng.random() < 0.4:
            pages[-1] = P - 1 - int(rng.integers(0, 3))  # a page of its own, away from the run
    return _with_map(rng, lists, [0.4, 0.5, 0.1])


def _with_map(rng: np.random.Generator, lists: list[np.ndarray], kinds: list[float]) -> tuple[np.ndarray, ...]:
    """``(flat, stage, starts, counts, map)`` of the requests' page ``lists``: staging ascending,
    and per (layer, request) every page host-only, none, or a random part (drawn with
    probabilities ``kinds``: resident, every page, a part)."""
    counts = np.array([x.size for x in lists], dtype=np.int64)
    starts = np.cumsum(counts) - counts
    flat = np.concatenate(lists).astype(np.int64)
    assert flat.max() < P
    stage = np.arange(flat.size, dtype=np.int64) + 3
    map_np = np.arange(L * P, dtype=np.int64).reshape(L, P) % 300
    kind = rng.choice(3, size=(L, len(lists)), p=kinds)
    for layer in range(L):
        for r in range(len(lists)):
            cols = np.arange(starts[r], starts[r] + counts[r])
            host = np.ones(cols.size, bool) if kind[layer, r] == 1 else rng.random(cols.size) < 0.5
            if kind[layer, r]:
                map_np[layer, flat[cols[host]]] = -1
    return flat, stage, starts, counts, map_np


FREE_GROUPS = {"reused": 0}


def _interleaved(rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """A long decode's page lists: each of 6 requests holds a few prompt pages, then decode
    pages handed out in turn across the batch (one request's 6 apart); the rest as :func:`_step`."""
    prompt = rng.integers(1, 4, size=6)
    decode = int(rng.integers(4, 8))  # at most 18 + 6 * 7 = 60 pages of the 64
    first = np.concatenate([[0], np.cumsum(prompt)[:-1]])
    base = int(prompt.sum())
    lists = [np.concatenate([np.arange(first[r], first[r] + prompt[r]), base + r + 6 * np.arange(decode)])
             for r in range(6)]
    return _with_map(rng, lists, [0.3, 0.6, 0.1])


def _spec(layer: int, reqs: np.ndarray, step: tuple[np.ndarray, ...]) -> PageFetch:
    """The fetch of ``reqs`` at ``layer``, its segments counted from the map (as the tables count them)."""
    flat, stage, starts, counts, map_np = step
    t = torch.zeros(1, dtype=torch.int32)  # the kernel's device views: unused by the copy engines' plan
    segments = int(fetch_page_indices(flat, stage, map_np[layer], reqs, starts, counts, 0, 2 * L, DEV_V)[0].size)
    return PageFetch(layer=layer, layers=L, dev_v=DEV_V, max_pages=int(counts.max()), segments=segments, reqs=t,
                     flat=t, stage=t, starts=t, counts=t, map_row=t,
                     host_arrays=(reqs, flat, stage, starts, counts, map_np[layer]))


def _plan(s: np.ndarray, d: np.ndarray) -> tuple:
    return plan_runs(s, d, 2 * L, 1)


def _check(cache: FetchRunCache, seeds: range, interleave: bool = False) -> tuple[int, int]:
    """Every layer's fetch of a few request sets per step, through ``cache``: the pairs are the
    fetch's own segments planned afresh (the reference). Returns (planned, reused)."""
    for seed in seeds:
        rng = np.random.default_rng(seed)
        step = _interleaved(rng) if interleave else _step(rng)
        cache.clear()
        request_sets = [np.arange(6), np.array([0, 2, 5]), np.array([1])]
        for layer in rng.permutation(L):  # any layer order: a plan shifts either way
            for reqs in request_sets:
                spec = _spec(int(layer), reqs, step)
                reused = cache.reused
                plan = cache.plan(spec, _plan)
                if cache.reused > reused and any(not np.isscalar(g[3]) for g in plan[0]):
                    FREE_GROUPS["reused"] += 1  # a reused plan with runs at a step of their own
                got = _pairs(plan)
                want = _pairs(_plan(*spec.indices()))
                assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), (seed, layer, reqs)
    return cache.planned, cache.reused


@pytest.mark.parametrize("free_steps", [False, True])
def test_a_reused_plan_is_the_fetchs_own(monkeypatch, free_steps):
    """Plans reused across layers copy exactly what each fetch's own segments say; plans are
    reused where the host-only pages repeat, and made where they do not. ``free_steps``: pages
    interleaved across the requests, as a long decode leaves them, and the free-step pass on at
    these sizes: reused plans hold runs at a host step of their own too."""
    if free_steps:
        monkeypatch.setattr(pitched_memcpy, "FREE_PITCH_MIN", 3)
    planned, reused = _check(FetchRunCache(), range(40), interleave=free_steps)
    assert reused > 100 and planned > 100, (planned, reused)
    if free_steps:
        assert FREE_GROUPS["reused"] > 20, FREE_GROUPS


def test_a_wrong_reuse_is_caught(monkeypatch):
    """Negative controls: a plan shifted one layer too far, and a plan reused whatever the
    layer's host-only pages, both copy other pairs."""
    real = fetch_run_cache.shifted
    monkeypatch.setattr(pitched_memcpy, "FREE_PITCH_MIN", 3)
    for interleave in (False, True):  # fixed-step runs, and runs at a step of their own
        with monkeypatch.context() as mp, pytest.raises(AssertionError):
            mp.setattr(fetch_run_cache, "shifted", lambda plan, rows: real(plan, rows + 2))
            _check(FetchRunCache(), range(40), interleave)
        with monkeypatch.context() as mp, pytest.raises(AssertionError):
            mp.setattr(fetch_run_cache, "same_pages", lambda keep, planned: planned is not None)
            _check(FetchRunCache(), range(40), interleave)


def test_a_new_step_forgets_the_last_ones_plans():
    """After :meth:`clear` (the engine's step start) nothing is reused, even with the same arrays
    rewritten in place: the control keeps the entries and copies the old plan."""
    rng = np.random.default_rng(7)
    step = _step(rng)
    reqs = np.arange(6)
    cache = FetchRunCache()
    cache.plan(_spec(2, reqs, step), _plan)
    flat, stage = step[0], step[1]
    stage[:] = stage[::-1].copy()  # the next step's staging, same array
    flat[:] = (flat + 1) % P
    cache.clear()
    spec = _spec(3, reqs, step)
    assert np.array_equal(_pairs(cache.plan(spec, _plan))[1], _pairs(_plan(*spec.indices()))[1])
    assert cache.reused == 0
    kept = FetchRunCache()
    kept.plan(_spec(2, reqs, _step(np.random.default_rng(7))), _plan)
    step2 = _step(np.random.default_rng(7))
    kept._entries = {(id(step2[0]), id(step2[1]), id(step2[2]), id(step2[3]), reqs.tobytes()): e
                     for e in kept._entries.values()}  # the old plan under the new arrays' key
    step2[1][:] = step2[1][::-1].copy()
    spec = _spec(2, reqs, step2)
    assert not np.array_equal(_pairs(kept.plan(spec, _plan))[1], _pairs(_plan(*spec.indices()))[1])


def test_whole_fetches_skip_the_map_and_a_count_the_map_contradicts_is_never_trusted():
    """A fetch of every page of its requests (by the tables' count) takes a whole planned
    fetch's plan without reading the map. A count that claims every page where the map says
    otherwise is planned from the map (the right pairs), counted in ``disagreed``, and no later
    fetch skips the map on its word. Control: trusting that count copies the wrong pairs."""
    rng = np.random.default_rng(3)
    step = _step(rng)
    flat, stage, starts, counts, map_np = step
    reqs = np.arange(6)
    cols = np.concatenate([np.arange(s, s + c) for s, c in zip(starts, counts, strict=True)])
    map_np[1, flat[cols]] = -1  # layers 1 and 2: every page host-only
    map_np[2, flat[cols]] = -1
    map_np[3] = np.arange(P)  # layer 3: every page but one resident, counted as if none were
    map_np[3, flat[cols[0]]] = -1
    cache = FetchRunCache()
    cache.plan(_spec(1, reqs, step), _plan)
    spec = _spec(2, reqs, step)
    assert np.array_equal(_pairs(cache.plan(spec, _plan))[0], _pairs(_plan(*spec.indices()))[0])
    assert cache.reused_whole == 1
    lie = dataclasses.replace(_spec(3, reqs, step), segments=2 * cols.size)
    want = _pairs(_plan(*lie.indices()))
    fresh = FetchRunCache()
    with capture_logs() as logs:
        assert np.array_equal(_pairs(fresh.plan(lie, _plan))[0], want[0]) and fresh.disagreed == 1
    assert [e["event"] for e in logs] == ["kv_fetch_count_disagrees_with_map"] and logs[0]["host_only"] == 1
    whole = _spec(1, reqs, step)
    fresh.plan(whole, _plan)  # the lie's entry: never whole, so this one reads the map
    assert fresh.reused_whole == 0 and fresh.planned == 2
    assert np.array_equal(_pairs(cache.plan(lie, _plan))[0], want[0]) is False  # control: trusted, it is wrong
