"""The copy engines' path (``--kv-copy-engine dma``) under the stream-order checker.

The served core runs with :class:`CudaTransferEngine` over CPU pools (``cuda_simulation.py``),
its copy-engine calls -- 2-D copies of strided runs, batched memcpys of the rest -- taken at the
pointer level by :class:`~tests.dataplane.pointer_memcpy.PointerMemcpy`: every address inside the
pool it names, the copy on the stream its handle names, KV exact at every step, every access
ordered. Split from ``test_stream_order.py``, whose scenario it runs.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from kernels import pitched_memcpy
from sglang_ext.dataplane import cuda_transfer_engine as te
from sglang_ext.dataplane import fetch_run_cache
from tests.dataplane.core_driver import PAGES, CoreDriver, make_core, offload_scenario
from tests.dataplane.cuda_simulation import install, track_core
from tests.dataplane.pointer_memcpy import PointerMemcpy
from tests.dataplane.stream_order import StreamOrder
from tests.dataplane.test_stream_order import _no_layer_waits, scenario


@pytest.mark.parametrize("dma_floor", [0, 64])
def test_the_copy_engines_path_keeps_every_access_ordered(monkeypatch, dma_floor):
    """``--kv-copy-engine dma``: fetches, write-backs, boundary moves and parked rows as batched
    memcpys of listed segments (host indices, no device index tensors) follow the same order,
    alone or mixed with the kernels (rows under the floor: the 32-byte token rows at 64); the
    negative control drops the layers' waits on their fetches."""
    sim, driver = scenario(monkeypatch, more_steps=20, dma=True, dma_floor=dma_floor)
    stats = driver.core.store.engine.stats
    launches = stats.h2d_launches + stats.d2h_launches
    assert sim.copies["dma"] >= launches // 2 and sim.violations == [], (sim.copies, launches)
    # two kernel copies at start (the kernels' warm-up: the pools' segments, the token rows)
    assert (sim.copies["kernel"] > 2) == (dma_floor > 0), sim.copies
    _no_layer_waits(monkeypatch)
    sim, _ = scenario(monkeypatch, more_steps=20, dma=True, dma_floor=dma_floor)
    assert any("read by compute" in v and "after a write by stream2" in v for v in sim.violations), sim.violations[:3]


def _shift_sources(mp: pytest.MonkeyPatch) -> None:
    """A negative control of the pointer check: every source address one row further on (a
    segment's, and a strided run's first row), still inside the pool: the wrong bytes."""
    real, real_runs = te.segment_pointers, te.run_pointers

    def shifted(src, dst, src_idx, dst_idx):  # noqa: ANN001, ANN202
        return real(src, dst, (np.asarray(src_idx) + 1) % src.shape[0], dst_idx)

    def shifted_runs(src_base, dst_base, row, src_start, dst_start):  # noqa: ANN001, ANN202
        return real_runs(src_base, dst_base, row, src_start + 1, dst_start)

    mp.setattr(te, "segment_pointers", shifted)
    mp.setattr(te, "run_pointers", shifted_runs)


def _long_runs(mp: pytest.MonkeyPatch) -> None:
    """A negative control of the 2-D copies: every strided run one row too long."""
    real = te.plan_runs

    def longer(*args):  # noqa: ANN002, ANN202
        groups, rest_s, rest_d = real(*args)
        return [(s0, d0, n + 1, s_step, d_step) for s0, d0, n, s_step, d_step in groups], rest_s, rest_d

    mp.setattr(te, "plan_runs", longer)


def _reuse_one_layer_off(mp: pytest.MonkeyPatch) -> None:
    """A negative control of the fetch plans reused across layers (``FetchRunCache``): each
    reused plan's host rows one layer further on than its own."""
    real = fetch_run_cache.shifted
    mp.setattr(fetch_run_cache, "shifted", lambda plan, rows: real(plan, rows + 2))


def _free_step_off(mp: pytest.MonkeyPatch) -> None:
    """A negative control of the free-step runs (a long decode's interleaved pages): each such
    run's host step one row more, with the pass on at toy sizes."""
    real = pitched_memcpy.free_pitch_runs

    def off(*args):  # noqa: ANN002, ANN202
        f0, h0, m, step = real(*args)
        return f0, h0, m, np.where(m > 1, step + 1, step)

    mp.setattr(pitched_memcpy, "free_pitch_runs", off)
    mp.setattr(pitched_memcpy, "FREE_PITCH_MIN", 3)


def _handle_of(which: str) -> Callable[[pytest.MonkeyPatch], None]:
    """Every copy-engine call (batched and 2-D) handed the stream handle of ``which`` (``compute``
    or ``h2d``: the engine's first side stream, stream2) whatever stream the engine is on."""
    def patch(mp: pytest.MonkeyPatch) -> None:
        real_copy, real_runs = PointerMemcpy.copy, PointerMemcpy.copy_runs

        def handle(self) -> int:  # noqa: ANN001
            return (self.sim.compute if which == "compute" else self.sim.streams[1]).cuda_stream

        mp.setattr(PointerMemcpy, "copy", lambda self, d, s, z, stream: real_copy(self, d, s, z, handle(self)))
        mp.setattr(PointerMemcpy, "copy_runs", lambda self, d, dp, s, sp, w, h, stream:
                   real_runs(self, d, dp, s, sp, w, h, handle(self)))
    return patch


def test_the_copy_engines_calls_are_right_at_the_pointer_level(monkeypatch):
    """The engine's copy-engine calls run as the driver would (``pointer_memcpy.py``): 2-D copies
    of strided runs (a layer's consecutive pages: 2L host rows apart, consecutive staging pages)
    and one batched memcpy of the rest. Every address lies in the pool it names, the bytes moved
    are the KV the driver expects at every step, and each call runs on the stream the engine's
    events describe; the same holds with the batched memcpy alone (2-D copies refused).
    Decode pages interleave across the batch, so some runs go at a host step of their own.
    A step's fetches of the same requests and host-only pages at two layers share one plan,
    shifted (``FetchRunCache``). Negative controls: source addresses one row off, runs one row
    too long, the free-step runs' host step one row off, or a reused plan one layer off (the KV
    check or the address check fails); every copy handed the
    compute stream's handle, or the H2D stream's (the order check fails)."""
    pitches: set[tuple[int, int]] = set()
    with monkeypatch.context() as mp:
        real_runs = PointerMemcpy.copy_runs

        def seen(self, d, dp, s, sp, w, h, stream):  # noqa: ANN001, ANN202
            rows_apart = (np.broadcast_to(np.asarray(p) // w, h.shape).tolist() for p in (sp, dp))
            pitches.update(zip(*rows_apart, strict=True))  # (source, destination) rows between a run's rows
            return real_runs(self, d, dp, s, sp, w, h, stream)

        mp.setattr(PointerMemcpy, "copy_runs", seen)
        mp.setattr(pitched_memcpy, "FREE_PITCH_MIN", 3)  # the free-step pass at toy sizes too
        sim, driver = scenario(mp, more_steps=20, dma=True)
    dma, rows = driver.core.store.engine._dma, driver.core.store.engine.host_page_rows
    reuse = driver.core.store.engine.fetch_runs
    assert reuse.reused > 5 and reuse.planned > 5, (reuse.planned, reuse.reused)  # plans shifted across layers
    assert reuse.reused_whole > 5 and reuse.disagreed == 0, (reuse.reused_whole, reuse.disagreed)  # no map read
    assert len(reuse._entries) <= 3, len(reuse._entries)  # the last step's only: each step start clears them
    assert sim.violations == [] and dma.runs > 20 and dma.copies > 100 and dma.bytes > 0, (dma.runs, dma.copies)
    assert {(rows, 1), (1, rows)} <= pitches, pitches  # fetches and onloads; write-backs (block-first host)
    # decode pages interleave across the batch: runs at a host pitch of their own (plan_runs)
    assert any(sp > rows and sp % rows == 0 and dp == 1 for sp, dp in pitches), pitches
    with monkeypatch.context() as mp:
        sim = install(mp, dma=True, pitched=False)
        core = make_core(PAGES + 6)
        track_core(sim, core)
        driver = CoreDriver(core, seed=1, fast_decode=True)
        with sim.tracer():
            offload_scenario(driver)
        assert sim.violations == [] and core.store.engine._dma.runs == 0 and core.store.engine._dma.copies > 50
    for broken in (_shift_sources, _long_runs, _free_step_off, _reuse_one_layer_off):
        with monkeypatch.context() as mp, pytest.raises((AssertionError, RuntimeError)):
            scenario(mp, broken, more_steps=20, dma=True)
    with monkeypatch.context() as mp:  # the write-backs run on compute: the host's fence misses them
        sim, _ = scenario(mp, _handle_of("compute"), more_steps=20, dma=True)
    assert any(v.startswith("read by host") and "after a write by compute" in v for v in sim.violations), sim.violations
    with monkeypatch.context() as mp:  # the write-backs run on the H2D stream, which never waited for compute
        sim, _ = scenario(mp, _handle_of("h2d"), more_steps=20, dma=True)
    h2d = driver.core.store.engine.h2d_stream.actor
    assert any(v.startswith(f"read by stream{h2d}") and "after a write by compute" in v for v in sim.violations), \
        sim.violations[:3]


def test_the_pointer_memcpy_copies_inside_tracked_memory_only():
    """``PointerMemcpy`` copies the bytes the addresses name, on the stream the handle names, and
    refuses a range that leaves the tracked allocation or a handle no stream has (the controls)."""
    from kernels.batched_memcpy import segment_pointers

    sim = StreamOrder()
    src, dst = torch.arange(24, dtype=torch.float32).view(6, 4), torch.zeros(3, 4)
    sim.track(src, host=True)
    sim.track(dst)
    side = sim._new_stream()
    dma = PointerMemcpy(sim)
    with sim.tracer():
        dma.copy(*segment_pointers(src, dst, np.array([5, 0, 2]), np.array([0, 1, 2])), side.cuda_stream)
    assert torch.equal(dst, src[[5, 0, 2]]) and not torch.equal(dst, src[[0, 1, 2]])
    assert sim.current is sim.compute and dma.copies == 3 and dma.bytes == 48
    assert any("by compute" in v and f"stream{side.actor}" in v for v in _read_on_compute(sim, dst))
    dsts, srcs, sizes = segment_pointers(src, dst, np.array([5]), np.array([2]))
    with pytest.raises(RuntimeError, match="not inside one tracked allocation"):
        dma.copy(dsts, srcs, sizes + np.uint64(4), side.cuda_stream)  # 4 bytes past dst's end
    with pytest.raises(KeyError, match="no stream has the handle"):
        dma.copy(dsts, srcs, sizes, 12345)


def _read_on_compute(sim: StreamOrder, t: torch.Tensor) -> list[str]:
    """The violations of a read of ``t`` on the compute stream with no wait (the side stream's
    copy wrote it)."""
    with sim.tracer():
        t.sum()
    return sim.violations


def _refused(which: str, after: int) -> Callable[[pytest.MonkeyPatch], None]:
    """The driver refuses every ``which`` call (``copy`` or ``copy_runs``) after the first ``after``."""
    def patch(mp: pytest.MonkeyPatch) -> None:
        real, calls = getattr(PointerMemcpy, which), [0]

        def refusing(self, *args):  # noqa: ANN001, ANN002, ANN202
            calls[0] += 1
            if calls[0] > after:
                raise RuntimeError(f"{which} refused (test)")
            return real(self, *args)

        mp.setattr(PointerMemcpy, which, refusing)
    return patch


@pytest.mark.parametrize("which", ["copy_runs", "copy"])
def test_a_copy_the_driver_refuses_while_serving_goes_another_way(monkeypatch, which):
    """Scenario: ``--kv-copy-engine dma`` serving, and the driver starts refusing the 2-D copies
    (or every copy-engine call) mid-run. No step fails: a refused 2-D copy turns them off and the
    batched memcpy takes the segments; a refused batched memcpy turns ``dma`` off and the kernels
    copy them, on the same stream. KV stays exact at every step and every access stays ordered.
    (Without the fallback the refusal would end the forward: the control.)"""
    sim, driver = scenario(monkeypatch, _refused(which, 10), more_steps=20, dma=True)
    engine = driver.core.store.engine
    assert sim.violations == []
    if which == "copy":
        assert engine.impl == "triton" and "refused (test)" in engine.dma_error and sim.copies["kernel"] > 5
        assert not engine.set_copy_engine("dma") and engine.impl == "triton"  # refused for good: not back on
    else:
        assert engine._pitched is None and "refused (test)" in engine.pitched_error
        assert engine.impl == "dma" and engine.dma_error is None and engine._dma.copies > 100
    from sglang_ext.dataplane.cuda_transfer_engine import CudaTransferEngine

    def no_fallback(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if self._pitched is not None:
            self._pitched.copy_runs(np.zeros(1, np.uint64), 8, np.zeros(1, np.uint64), 8, 8, np.ones(1, np.int64), 0)
        self._dma.copy(np.zeros(1, np.uint64), np.zeros(1, np.uint64), np.full(1, 8, np.uint64), 0)
        return True

    with monkeypatch.context() as mp, pytest.raises(RuntimeError, match="refused"):
        mp.setattr(CudaTransferEngine, "_dma_copy", no_fallback)
        scenario(mp, _refused(which, 0), more_steps=2, dma=True)
