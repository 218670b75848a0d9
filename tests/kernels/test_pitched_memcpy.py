"""kernels.pitched_memcpy on the CPU: a launch's segments as strided runs (replayed here with
``ctypes.memmove``, row for row at the runs' pitches, as the copy engines would) equal the
torch reference ``dst[dst_idx] = src[src_idx]``; a fetch of consecutive pages into consecutive
staging pages is one run per request; the descriptors handed to the driver have ``cuda.h``'s
``CUDA_MEMCPY2D`` layout; without a CUDA driver the binding refuses with a message naming it and
the subprocess probe reports why instead of crashing. The copies on the copy engines themselves
are ``gpu`` tests (tests/dataplane/test_gpu.py)."""

import ctypes

import numpy as np
import pytest
import torch

from kernels import pitched_memcpy
from kernels.pitched_memcpy import (
    RECORD,
    PitchedMemcpy,
    _Memcpy2D,
    free_pitch_runs,
    plan_runs,
    probe_in_subprocess,
    run_pointers,
    strided_runs,
)

L = 4
"""Layers of the toy block-first pool: a page's K and V of layer l are host rows 2L * page + 2l (+1)."""


def _expand(s0: np.ndarray, d0: np.ndarray, n: np.ndarray, s_step: int | np.ndarray,
            d_step: int | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The pairs of runs ``(s0, d0, n)`` at their steps (one for all runs, or one per run)."""
    k = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    s_step, d_step = np.broadcast_to(s_step, n.shape), np.broadcast_to(d_step, n.shape)
    return np.repeat(s0, n) + k * np.repeat(s_step, n), np.repeat(d0, n) + k * np.repeat(d_step, n)


def test_runs_expand_back_to_the_pairs_and_are_maximal():
    """Any pairs: the runs give back exactly the pairs, in order, and no run continues the one
    before it. Negative control: a run starting one row later gives other pairs."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(1, 60))
        src = np.cumsum(rng.choice([2 * L, 2 * L, 2 * L, 1, 5], size=n)) + int(rng.integers(0, 9))
        dst = np.cumsum(rng.choice([1, 1, 1, 2, -3], size=n)) + 40
        s0, d0, k = strided_runs(src, dst, 2 * L, 1)
        s, d = _expand(s0, d0, k, 2 * L, 1)
        assert np.array_equal(s, src) and np.array_equal(d, dst)
        nxt = (s0[1:] == s0[:-1] + k[:-1] * 2 * L) & (d0[1:] == d0[:-1] + k[:-1])
        assert not nxt.any()
    moved = s0.copy()
    moved[-1] += 1  # the last run starting one row later: same length, other pairs
    assert not np.array_equal(_expand(moved, d0, k, 2 * L, 1)[0], src)


def _groups(groups: list) -> tuple[np.ndarray, ...]:
    """:func:`plan_runs`' groups as one ``(src_start, dst_start, length, src_step, dst_step)``
    with a step per run."""
    if not groups:
        return tuple(np.zeros(0, dtype=np.int64) for _ in range(5))
    parts = [(s0, d0, n, np.broadcast_to(ss, n.shape), np.broadcast_to(ds, n.shape)) for s0, d0, n, ss, ds in groups]
    return tuple(np.concatenate(column) for column in zip(*parts, strict=True))


def test_free_pitch_runs_are_progressions_that_give_back_the_pairs():
    """Any pairs (random, structured, progressions meeting at a pair): every run is one
    progression at its own free step (>= 1) and the fixed step, and the runs give back exactly
    the pairs in order. Negative control: a run's step one off gives other pairs."""
    rng = np.random.default_rng(1)
    checked = 0
    for trial in range(600):
        n = int(rng.integers(0, 60))
        if trial % 3 == 0:
            free, fixed = rng.integers(0, 40, n), rng.integers(0, 40, n)
        elif trial % 3 == 1:
            free, fixed = np.cumsum(rng.choice([1, 2, 3, 8], n)), np.cumsum(rng.choice([1, 1, 1, 2], n))
        else:
            free, fixed = np.cumsum(rng.choice([6, 6, 6, 24, 24, 5], n)), np.arange(n) + 3
        f0, h0, m, step = free_pitch_runs(fixed, free, 1)
        got_f, got_h = _expand(f0, h0, m, np.ones_like(m), step)
        assert np.array_equal(got_h, free) and np.array_equal(got_f, fixed)
        assert (step[m > 1] >= 1).all() and (step[m == 1] == 0).all()
        if (m > 2).any():
            checked += 1
            bad = step.copy()
            bad[np.flatnonzero(m > 2)[0]] += 1
            assert not np.array_equal(_expand(f0, h0, m, np.ones_like(m), bad)[1], free)
    assert checked > 100
    # two progressions sharing pair 3 (steps 2 then 5): the later one gives up its first link
    f0, h0, m, step = free_pitch_runs(np.arange(7), np.array([0, 2, 4, 6, 11, 16, 21]), 1)
    assert m.tolist() == [4, 3] and step.tolist() == [2, 5] and h0.tolist() == [0, 11]


def test_a_long_decodes_interleaved_pages_are_runs_at_their_own_pitch():
    """Four requests with 8 prompt pages each, then 30 decode pages each handed out in turn
    (request r's decode pages 4 apart): a layer's fetch into consecutive staging pages is one
    run at 2L plus one at 4 x 2L per request (8 runs for 152 segments, none left single). With
    the fixed step alone (the negative control) each decode page is a run of its own."""
    reqs, prompt, decode = 4, 8, 30
    pages = [list(range(100 + 10 * r, 100 + 10 * r + prompt)) + [500 + t * reqs + r for t in range(decode)]
             for r in range(reqs)]
    src = np.concatenate([np.array(p) * 2 * L + 2 for p in pages])
    dst = np.arange(src.size) + 7
    groups, rest_s, rest_d = plan_runs(src, dst, 2 * L, 1)
    s0, d0, n, s_step, d_step = _groups(groups)
    assert len(groups) == 2 and n.size == 2 * reqs and rest_s.size == 0
    assert sorted(set(s_step.tolist())) == [2 * L, 4 * 2 * L] and set(d_step.tolist()) == {1}
    got_s, got_d = _expand(s0, d0, n, s_step, d_step)
    assert sorted(zip(got_s.tolist(), got_d.tolist(), strict=True)) == sorted(zip(src.tolist(), dst.tolist(), strict=True))
    assert strided_runs(src, dst, 2 * L, 1)[2].size == reqs * (1 + decode)
    # write-backs (the host is the destination): the same runs, mirrored
    groups, rest_s, _ = plan_runs(dst, src, 1, 2 * L)
    s0, d0, n, s_step, d_step = _groups(groups)
    assert n.size == 2 * reqs and rest_s.size == 0 and sorted(set(d_step.tolist())) == [2 * L, 4 * 2 * L]


@pytest.mark.parametrize("min_run", [2, 3, 5])
def test_plan_runs_leaves_pairs_single_only_where_no_progression_holds(monkeypatch, min_run):
    """Random pairs, the free-step pass on from 3 pairs left: the runs (each ``min_run`` rows or
    more, at most ``max_step`` apart) and the pairs left together are exactly the pairs; both
    pools unpitched (a device copy) gets no free-step pass; ``min_run`` below 2 is refused."""
    monkeypatch.setattr(pitched_memcpy, "FREE_PITCH_MIN", 3)
    rng = np.random.default_rng(2)
    free_runs = 0
    for _ in range(300):
        n = int(rng.integers(0, 200))
        src, dst = np.cumsum(rng.choice([2 * L, 3 * 2 * L, 1, 7, 40], n)), np.cumsum(rng.choice([1, 1, 2], n))
        for steps in ((2 * L, 1), (1, 2 * L), (1, 1)):
            a, b = (src, dst) if steps[0] > 1 or steps == (1, 1) else (dst, src)
            s0, d0, m, ss, ds = _groups((groups := plan_runs(a, b, *steps, min_run, 3 * 2 * L))[0])
            rest_s, rest_d = groups[1], groups[2]
            free_runs += len(groups) > 1
            assert (m >= min_run).all() and (ss <= 3 * 2 * L).all() and (ds <= 3 * 2 * L).all()
            got_s, got_d = _expand(s0, d0, m, ss, ds)
            pairs = sorted(zip(np.concatenate([got_s, rest_s]).tolist(), np.concatenate([got_d, rest_d]).tolist(),
                                  strict=True))
            assert pairs == sorted(zip(a.tolist(), b.tolist(), strict=True))
            if steps == (1, 1):
                assert set(ss.tolist()) <= {1} and set(ds.tolist()) <= {1}
    assert free_runs > 50  # the free-step pass found runs
    with pytest.raises(ValueError, match="min_run"):
        plan_runs(np.arange(4), np.arange(4), 2, 1, 1)


def test_free_step_runs_stay_within_the_drivers_pitch():
    """A run's free step is at most ``max_step`` (the driver's largest pitch in rows): pages 1,000
    rows apart stay single under a bound of 999, form one run without it (the control)."""
    far, fixed = np.arange(6) * 1000, np.arange(6)
    assert free_pitch_runs(fixed, far, 1)[2].tolist() == [6]
    assert free_pitch_runs(fixed, far, 1, max_step=999)[2].tolist() == [1] * 6
    assert free_pitch_runs(fixed, far, 1, max_step=1000)[3].tolist() == [1000]


def test_the_drivers_max_pitch_is_asked_and_defaults():
    """``max_pitch`` reads ``CU_DEVICE_ATTRIBUTE_MAX_PITCH`` through ``cuDeviceGet`` and
    ``cuDeviceGetAttribute``; a driver that fails or lacks them gives ``MAX_PITCH_BYTES``."""
    asked: list[tuple[int, int]] = []
    rc = {"get": 0, "attr": 0}

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int)
    def get(dev, ordinal):  # noqa: ANN001, ANN202
        dev[0] = 40 + ordinal
        return rc["get"]

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int)
    def attr(value, attribute, dev):  # noqa: ANN001, ANN202
        asked.append((attribute, dev))
        value[0] = 12345
        return rc["attr"]

    pm = PitchedMemcpy.__new__(PitchedMemcpy)
    pm._lib = type("Lib", (), {"cuDeviceGet": get, "cuDeviceGetAttribute": attr})()
    assert pm.max_pitch(1) == 12345 and asked == [(pitched_memcpy.MAX_PITCH_ATTRIBUTE, 41)]
    rc["attr"] = 1
    assert pm.max_pitch(1) == pitched_memcpy.MAX_PITCH_BYTES
    rc["get"], rc["attr"] = 100, 0
    assert pm.max_pitch(0) == pitched_memcpy.MAX_PITCH_BYTES
    pm._lib = object()
    assert pm.max_pitch(0) == pitched_memcpy.MAX_PITCH_BYTES


def test_a_layers_fetch_of_consecutive_pages_is_one_run_per_request_and_half():
    """Two requests whose pages 10..14 and 30..32 are fetched at layer 2 into staging pages 7..14
    (K segments, then V: host row + 1, device row + dev_v): four runs, one per request and half."""
    pages = np.array([10, 11, 12, 13, 14, 30, 31, 32])
    stage = np.arange(7, 15)
    k_src, dev_v = pages * 2 * L + 2 * 2, 100
    src, dst = np.concatenate([k_src, k_src + 1]), np.concatenate([stage, stage + dev_v])
    s0, d0, n = strided_runs(src, dst, 2 * L, 1)
    assert n.tolist() == [5, 3, 5, 3] and s0.tolist() == [84, 244, 85, 245] and d0.tolist() == [7, 12, 107, 112]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_runs_replayed_at_their_pitches_equal_the_reference(dtype):
    """A block-first host pool ``[P * 2L, row]`` and a device pool: the fetch's runs, replayed row
    by row at the pitches the engine passes, equal ``dev[dst] = host[src]``; a source pitch one
    row off (the negative control) does not."""
    gen = torch.Generator().manual_seed(2)
    host = (torch.rand((16 * 2 * L, 24), generator=gen) * 100).to(dtype)
    row = 24 * host.element_size()
    pages, stage = np.array([3, 4, 5, 9, 10, 2]), np.array([1, 2, 3, 4, 5, 9])
    src = np.concatenate([pages * 2 * L + 2, pages * 2 * L + 3])
    dst = np.concatenate([stage, stage + 12])
    want = torch.zeros((24, 24), dtype=dtype)
    want[torch.from_numpy(dst)] = host[torch.from_numpy(src)]
    for pitch_off, equal in ((0, True), (1, False)):
        dev = torch.zeros((24, 24), dtype=dtype)
        s0, d0, n = strided_runs(src, dst, 2 * L, 1)
        dsts, srcs = run_pointers(host.data_ptr(), dev.data_ptr(), row, s0, d0)
        for ds, ss, h in zip(dsts.tolist(), srcs.tolist(), n.tolist(), strict=True):
            for k in range(h):
                ctypes.memmove(ds + k * row, ss + k * (2 * L + pitch_off) * row, row)
        assert torch.equal(dev, want) == equal


def test_descriptors_have_the_driver_layout():
    """The record array the driver reads is ``CUDA_MEMCPY2D``: 128 bytes, size_t fields at the
    offsets of ``cuda.h``, both operands unified addresses, one record per run with its pitch,
    width and height (read back through the ctypes struct, as the driver would read it)."""
    assert RECORD.itemsize == ctypes.sizeof(_Memcpy2D) == 128
    assert [RECORD.fields[f][1] for f in ("srcMemoryType", "srcDevice", "srcPitch", "dstMemoryType", "dstDevice",
                                          "dstPitch", "WidthInBytes", "Height")] == [16, 32, 48, 72, 88, 104, 112, 120]
    seen: list[tuple] = []
    pm = PitchedMemcpy.__new__(PitchedMemcpy)
    pm.calls = pm.rows = 0
    pm.call_seconds = 0.0

    def fn(ptr, stream):  # noqa: ANN001, ANN202 - what the driver would read at ``ptr``
        op = ctypes.cast(ptr, ctypes.POINTER(_Memcpy2D)).contents
        seen.append((op.srcMemoryType, op.srcDevice, op.srcPitch, op.dstMemoryType, op.dstDevice, op.dstPitch,
                     op.WidthInBytes, op.Height, op.srcXInBytes, op.srcY, stream.value))
        return 0

    pm._fn = fn
    pm.copy_runs(np.array([1000, 5000], dtype=np.uint64), 64, np.array([7, 9], dtype=np.uint64), 512, 64,
                 np.array([3, 1]), 77)
    assert seen == [(4, 7, 512, 4, 1000, 64, 64, 3, 0, 0, 77), (4, 9, 512, 4, 5000, 64, 64, 1, 0, 0, 77)]
    assert pm.calls == 2 and pm.rows == 4
    with pytest.raises(ValueError, match="over a pitch"):
        pm.copy_runs(np.array([0], dtype=np.uint64), 32, np.array([0], dtype=np.uint64), 512, 64, np.array([1]), 0)
    seen.clear()  # a pitch per run (plan_runs' free-step runs): each record gets its own
    pm.copy_runs(np.array([1000, 5000], dtype=np.uint64), 64, np.array([7, 9], dtype=np.uint64),
                 np.array([512, 2048]), 64, np.array([3, 2]), 5)
    assert [(op[2], op[5], op[7]) for op in seen] == [(512, 64, 3), (2048, 64, 2)]
    for bad_pitch in (np.array([512, 32]), np.array([512, 512, 512])):  # under the width; not one per run
        with pytest.raises(ValueError, match="over a pitch"):
            pm.copy_runs(np.array([0, 8], dtype=np.uint64), 64, np.array([0, 8], dtype=np.uint64), bad_pitch, 64,
                         np.array([1, 1]), 0)


def test_bad_runs_are_refused():
    with pytest.raises(ValueError, match="steps must be >= 1"):
        strided_runs(np.array([0]), np.array([0]), 0, 1)
    with pytest.raises(ValueError, match="one length"):
        strided_runs(np.array([0, 1]), np.array([0]), 1, 1)
    assert all(a.size == 0 for a in strided_runs(np.zeros(0), np.zeros(0), 1, 1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host has the driver")
def test_without_a_driver_the_binding_and_the_probe_say_why():
    with pytest.raises(RuntimeError, match="CUDA driver library is not loadable"):
        PitchedMemcpy()
    batched, pitched = probe_in_subprocess()
    assert batched is not None and "not loadable" in batched and pitched == batched


def test_one_probe_child_reports_each_stage(monkeypatch):
    """Both copy-engine probes run in one child (one process start, one CUDA context): a stage whose
    line came passed, even when the child then dies in the next one (the 2-D probe faulting in the
    driver leaves the batched memcpy usable); stages after a failed one are not probed. A stub
    child stands in for the driver; the control passes no stage."""
    from kernels.batched_memcpy import probe_stages_in_subprocess
    from kernels.pitched_memcpy import PROBE_STAGES

    monkeypatch.setenv("PROBE_STUB_PASSES", PROBE_STAGES[0])
    batched, pitched = probe_stages_in_subprocess(0, 60, "tests.kernels.probe_child_stub", PROBE_STAGES)
    assert batched is None and pitched == "the probe exited with 3: a fault in the next probe"
    monkeypatch.setenv("PROBE_STUB_PASSES", "")
    assert probe_stages_in_subprocess(0, 60, "tests.kernels.probe_child_stub", PROBE_STAGES) == [pitched, pitched]
