"""TransferCheck: the served engine's batched block-first copies, on the check's own core.

On the :class:`~sglang_ext.tools.gpu_check_batch.CheckBatch`'s store (its pinned block-first
host pool ``[P, L, 2, page, H, D]``, device page pool and transfer engine -- what SGLang's
layered pool issues), with two groups of free device pages taken from the staging room:

- ``h2d``: one ``engine.h2d`` launch of K and V of one layer of every page of the batch (what a
  step's first fetch is) -- also the placement model's bandwidth (layer-pages per ms);
- ``contiguous``: one pinned ``copy_`` of the same number of bytes (the ceiling);
- ``d2h``: one ``engine.d2h`` of the second group back to the host segments it was filled from
  (the same bytes: nothing the batch holds changes);
- ``duplex``: the H2D and the D2H issued together (the engine's two streams), bytes of both over
  the time of both, vs the H2D alone;
- ``h2d_event_gbps`` / ``d2h_event_gbps``: the same H2D and D2H loops as the data plane's own
  timing account sees them (``core.transfer_times``: CUDA-event pairs on the transfer streams,
  harvested after the loop's final sync): bytes launched / seconds booked. This is what
  ``kvplane:h2d_seconds_total`` and ``kvplane:d2h_seconds_total`` measure when serving;
- ``by_programs`` (CUDA): the H2D and duplex GB/s again with the engine's copy launches capped
  at each of ``PROGRAM_CAPS`` (``CudaTransferEngine.copy_programs``): what a cap that leaves SMs
  to the layers costs the link, beside the overlap phase's step times at the same caps;
  ``by_programs["dma"]`` (the copy engines) also has ``h2d_interleaved_gbps``: the same H2D with
  the pages in a long decode's order (:func:`interleaved`), which goes as 2-D copies at a host
  step of their own (``interleaved_runs_per_launch`` of them, ``interleaved_pitch_mib`` apart).

On the CPU the engine copies synchronously: the figures are measured the same way but say
nothing about a GPU link (reported N/A).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from sglang_ext.dataplane.bench_env import sync, time_ms
from sglang_ext.dataplane.cuda_transfer_engine import DMA_MIN_BYTES
from sglang_ext.tools.gpu_check_batch import CheckBatch
from sglang_ext.tools.gpu_check_config import PROGRAM_CAPS

INTERLEAVE = 32
"""The requests a long decode's pages interleave across (the check's batch size): the stride of
the copy engines' interleaved H2D (:func:`interleaved`)."""


def interleaved(pages: np.ndarray, k: int = INTERLEAVE) -> np.ndarray:
    """``pages`` in the order a long decode leaves one request's pages in: every ``k``-th together
    (pages ``i, i + k, i + 2k, ...``, then ``i + 1, ...``), so consecutive ones are ``k`` pages
    apart on the host (``k x 2L`` rows): one free-step run per residue on the copy engines
    (:func:`kernels.pitched_memcpy.plan_runs`), at a pitch ``k`` times the prompt pages'."""
    return pages[np.argsort(np.arange(pages.size) % k, kind="stable")]


def dma_phase_failed(phase: str, exc: BaseException, batch: Any) -> str:
    """A copy-engine phase raised (its first run on new hardware): the traceback printed, the
    engine's copies drained where they still can be, the batch's last decoded token written
    again at every layer (a fault inside a layer ends the step there: :meth:`CheckBatch.
    rewrite_decoded_token`, so the accuracy checks after this read what they regenerate), and
    why, for the phase's ``dma_error``. The check goes on without the copy engines; the other
    phases' figures are kept."""
    traceback.print_exc()
    try:
        batch.core.store.engine.quiesce()
        sync(batch.device)
        # the forward the fault left open ends first (its parked tokens written back, staging
        # returned, the compute mark its launches would have cleared cleared), so the rewrite's
        # at-rest writes and whatever copies follow them are ordered as between any two steps
        batch.core.pipeline.end_step()
        batch.rewrite_decoded_token()
        sync(batch.device)
    except Exception:  # noqa: BLE001 - a broken CUDA context fails the phases after this one on its own
        traceback.print_exc()
    return f"{phase} raised {type(exc).__name__}: {exc}"


def refused_midway(eng: Any) -> str | None:
    """Why what was just measured on the copy engines is void, or None: the driver refused a call
    inside the block (``CudaTransferEngine._dma_copy`` then turns ``dma`` off and the kernels copy
    the rest, so the figures mix the two)."""
    if getattr(eng, "impl", "dma") == "dma":
        return None
    return f"the driver refused a copy-engine call midway ({eng.dma_error}); the kernels finished the copies"


class CopyEnginePhase:
    """One of gpu-check's phases on the copy engines, each of which ran on hardware nobody ran
    them on: ``with CopyEnginePhase(phase, batch) as dma:`` measures inside when ``dma.on``
    (the batch's engine took the copy engines; it goes back to its kernels at the block's end).
    After the block ``dma.error`` is None when what ran inside ran on the copy engines alone,
    else why the phase's copy-engine figures are void: the engine refused them at the switch
    (``dma.on`` False), or the driver refused a call midway (:func:`refused_midway`: the kernels
    finished the copies), or the block raised -- then the exception is reported and absorbed
    (:func:`dma_phase_failed`: traceback, copies drained, the batch mended) and the check goes
    on without the copy engines."""

    def __init__(self, phase: str, batch: Any) -> None:
        self.phase, self.batch = phase, batch
        self.on = False
        self.error: str | None = None

    def __enter__(self) -> CopyEnginePhase:
        eng = self.batch.core.store.engine
        self.on = eng.set_copy_engine("dma")
        if not self.on:
            self.error = eng.dma_error
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        eng = self.batch.core.store.engine
        midway = refused_midway(eng) if self.on and exc is None else None
        if self.on:
            eng.set_copy_engine("triton")  # back on the kernels whatever happened
        if exc is None:
            self.error = self.error or midway
            return False
        if not isinstance(exc, Exception):  # an interrupt is not the copy engines' fault
            return False
        self.error = dma_phase_failed(self.phase, exc, self.batch)
        return True


@dataclass(frozen=True)
class TransferResult:
    """One layer of every page of the batch, each way."""

    layer_pages: int
    """Layer-pages moved per launch (K and V segments of each)."""
    bytes: int
    """Bytes per launch."""
    engine: str
    """The transfer engine (and its copy implementation on CUDA)."""
    h2d_ms: float
    h2d_gbps: float
    contiguous_gbps: float
    d2h_gbps: float
    duplex_gbps: float
    """Bytes of an H2D and a D2H issued together over their joint time."""
    h2d_event_gbps: float | None = None
    """GB/s of the ``h2d`` loop from the engine's timing account (None: nothing booked)."""
    d2h_event_gbps: float | None = None
    """GB/s of the ``d2h`` loop from the engine's timing account (None: nothing booked)."""
    by_programs: dict[str, dict[str, float]] | None = None
    """Cap (``PROGRAM_CAPS`` but the default) -> ``{"h2d_gbps", "duplex_gbps"}``, and ``dma``
    (the copy engines, ``--kv-copy-engine dma``) when they ran; None where the engine has no cap
    (the CPU's)."""
    dma_error: str | None = None
    """Why the copy engines were not measured (None: they were, in ``by_programs["dma"]``)."""

    @property
    def h2d_vs_contiguous(self) -> float:
        return self.h2d_gbps / self.contiguous_gbps

    @property
    def duplex_vs_one_direction(self) -> float:
        return self.duplex_gbps / self.h2d_gbps

    @property
    def bw_blocks_per_ms(self) -> float:
        """The placement model's bandwidth: layer-pages per ms of one batched fetch."""
        return self.layer_pages / self.h2d_ms

    def served_bw_blocks_per_ms(self, on_dma: bool) -> float:
        """The model's bandwidth on the engine that serves: scaled to the copy engines' H2D where
        they serve (``on_dma``, measured in ``by_programs["dma"]``), else the kernels'."""
        dma = (self.by_programs or {}).get("dma") if on_dma else None
        return self.bw_blocks_per_ms * (dma["h2d_gbps"] / self.h2d_gbps if dma else 1.0)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "h2d_vs_contiguous": self.h2d_vs_contiguous,
                "duplex_vs_one_direction": self.duplex_vs_one_direction,
                "bw_blocks_per_ms": self.bw_blocks_per_ms}


class TransferCheck:
    """Measures :class:`TransferResult` on a batch's store (module docstring)."""

    def __init__(self, batch: CheckBatch, repeat: int, dma_error: str | None = "not asked for") -> None:
        """``dma_error``: None to measure the copy engines too (CUDA: the engine probes them when
        asked, :meth:`CudaTransferEngine.set_copy_engine`), else why not."""
        self.batch, self.repeat, self.dma_error = batch, repeat, dma_error

    def measure(self) -> TransferResult:
        b = self.batch
        core, device = b.core, b.device
        store, eng = core.store, core.store.engine
        pages = b.all_pages()
        n = int(pages.size)
        layers = b.config.layers
        la, lb = 0, min(1, layers - 1)
        ids_a = core.room.take(n)
        ids_b = core.room.take(n)
        if ids_a is None or ids_b is None:
            raise RuntimeError(f"TransferCheck: no {2 * n} free device pages for the copies")
        try:
            src_a, dst_a = store.host_segs(np.full(n, la), pages), store.dev_segs(ids_a)
            src_b, dst_b = store.dev_segs(ids_b), store.host_segs(np.full(n, lb), pages)
            idx = [eng.index_tensor(x) for x in (src_a, dst_a, src_b, dst_b)]
            fill = [eng.index_tensor(x) for x in (dst_b, src_b)]
            eng.h2d(fill[0], fill[1], host_idx=(dst_b, src_b))  # group b holds layer lb's host bytes
            sync(device)

            def h2d() -> None:
                eng.h2d(idx[0], idx[1], host_idx=(src_a, dst_a))

            def d2h() -> None:
                eng.d2h(idx[2], idx[3], host_idx=(src_b, dst_b))

            def duplex() -> None:
                h2d()
                d2h()

            src_i = store.host_segs(np.full(n, la), interleaved(pages))
            idx_i = eng.index_tensor(src_i)

            def h2d_interleaved() -> None:  # the same bytes, a long decode's page order (copy engines)
                eng.h2d(idx_i, idx[1], host_idx=(src_i, dst_a))

            h2d_ms, h2d_event_gbps = self._timed(h2d, "h2d")
            d2h_ms, d2h_event_gbps = self._timed(d2h, "d2h")
            both_ms = time_ms(duplex, device, self.repeat)
            nbytes = int(src_a.size) * eng.segment_bytes
            elt = torch.empty((), dtype=b.dtype).element_size()
            cuda = device.startswith("cuda")
            flat_host = torch.empty(nbytes // elt, dtype=b.dtype, pin_memory=cuda)
            flat_dev = torch.empty(nbytes // elt, dtype=b.dtype, device=device)
            contig_ms = time_ms(lambda: flat_dev.copy_(flat_host, non_blocking=True), device, self.repeat)
            nbytes_both = 2 * int(src_a.size) * eng.segment_bytes
            by_programs = None
            if hasattr(eng, "copy_programs"):
                by_programs, before = {}, eng.copy_programs
                try:
                    for cap in PROGRAM_CAPS:
                        if cap is None:
                            continue
                        eng.copy_programs = cap
                        by_programs[str(cap)] = self._link(h2d, duplex, nbytes_both)
                finally:
                    eng.copy_programs = before
                by_programs.update(self._dma(eng, h2d, duplex, nbytes_both, h2d_interleaved))
        finally:
            eng.quiesce()
            sync(device)
            core.room.give_back(ids_b)
            core.room.give_back(ids_a)
        gbps = lambda ms: nbytes / ms / 1e6  # noqa: E731
        engine = type(eng).__name__ + (f" ({eng.impl})" if hasattr(eng, "impl") else "")
        return TransferResult(layer_pages=n, bytes=nbytes, engine=engine, h2d_ms=h2d_ms, h2d_gbps=gbps(h2d_ms),
                              contiguous_gbps=gbps(contig_ms), d2h_gbps=gbps(d2h_ms),
                              duplex_gbps=2 * nbytes / both_ms / 1e6, h2d_event_gbps=h2d_event_gbps,
                              d2h_event_gbps=d2h_event_gbps, by_programs=by_programs, dma_error=self.dma_error)

    def _dma(self, eng: Any, h2d: Callable[[], None], duplex: Callable[[], None], nbytes_both: int,
             h2d_interleaved: Callable[[], None]) -> dict[str, dict[str, float]]:
        """H2D and duplex GB/s with the copy engines (``dma``), and the H2D of the same bytes in a
        long decode's page order (``h2d_interleaved_gbps``, with its 2-D copies per launch and
        their pitch), or nothing (``dma_error`` says why); the engine goes back to its kernels
        after."""
        if self.dma_error is not None:
            return {}
        if eng.segment_bytes < DMA_MIN_BYTES:
            self.dma_error = (f"segments of {eng.segment_bytes} B < {DMA_MIN_BYTES} B: the copies would stay on "
                              "the Triton kernel")
            return {}
        link: dict[str, dict[str, float]] = {}
        with CopyEnginePhase("the transfer check on the copy engines", self.batch) as dma:
            if dma.on:
                link = self._dma_link(eng, h2d, duplex, nbytes_both, h2d_interleaved)
        self.dma_error = dma.error
        return {} if dma.error else link

    def _dma_link(self, eng: Any, h2d: Callable[[], None], duplex: Callable[[], None], nbytes_both: int,
                  h2d_interleaved: Callable[[], None]) -> dict[str, dict[str, float]]:
        """The copy engines' figures (the engine on them: :class:`CopyEnginePhase`)."""
        link = self._link(h2d, duplex, nbytes_both)
        pitched, calls = getattr(eng, "_pitched", None), [0]
        runs0 = pitched.calls if pitched is not None else 0

        def counted() -> None:
            calls[0] += 1
            h2d_interleaved()

        ms = time_ms(counted, self.batch.device, self.repeat)
        runs = (pitched.calls - runs0) if pitched is not None and eng._pitched is pitched else 0
        link.update({"h2d_interleaved_gbps": nbytes_both / 2 / ms / 1e6,
                     "interleaved_runs_per_launch": runs / max(1, calls[0]),
                     "interleaved_pitch_mib": INTERLEAVE * eng.host_page_rows * eng.segment_bytes / 2**20})
        return {"dma": link}

    def _link(self, h2d: Callable[[], None], duplex: Callable[[], None], nbytes_both: int) -> dict[str, float]:
        """H2D and duplex GB/s of the engine's copies as they are set now."""
        device = self.batch.device
        return {"h2d_gbps": nbytes_both / 2 / time_ms(h2d, device, self.repeat) / 1e6,
                "duplex_gbps": nbytes_both / time_ms(duplex, device, self.repeat) / 1e6}

    def _timed(self, fn: Callable[[], None], kind: str) -> tuple[float, float | None]:
        """The median wall ms of ``fn`` (one ``kind`` launch), and the GB/s that the engine's timing
        account books over the same launches (warm-ups included on both sides of the ratio)."""
        core = self.batch.core
        eng, times = core.store.engine, core.transfer_times

        def account() -> tuple[float, int]:
            eng.clock.harvest()  # non-blocking; everything issued so far has completed (synced)
            if kind == "h2d":
                return times.h2d_s, eng.stats.h2d_segments
            return times.d2h_s, eng.stats.d2h_segments

        seconds0, segments0 = account()
        ms = time_ms(fn, self.batch.device, self.repeat)  # ends synchronised: every pair completed
        seconds1, segments1 = account()
        seconds = seconds1 - seconds0
        gbps = (segments1 - segments0) * eng.segment_bytes / seconds / 1e9 if seconds > 0 else None
        return ms, gbps
