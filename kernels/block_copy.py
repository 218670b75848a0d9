"""Batched segment copy: one launch moves many KV blocks between pools (gather/scatter).

Both pools are viewed as 2-D ``[num_segments, segment_elems]`` tensors. A *segment* is one
layer-block of K (or of V): ``block_size * kv_heads * head_dim`` elements, contiguous in both
the device pool (``[2, N, bs, H, D]``) and the block-first host pool (``[hb, L, 2, bs, H, D]``).
``copy_segments(src, dst, src_idx, dst_idx)`` does ``dst[dst_idx[i]] = src[src_idx[i]]`` for
all i in one kernel launch (SuperInfer §4.3.2 merges per-segment copies into one batched launch;
we do it with a gather/scatter kernel instead of ``cudaMemcpyBatchAsync``).

On CUDA the host pool is pinned, so the kernel reads/writes it directly through unified virtual
addressing (zero-copy, no per-block ``cudaMemcpyAsync``). On CPU the Triton kernel runs only
under ``TRITON_INTERPRET=1``; :func:`copy_segments` otherwise uses the torch reference.
"""

from __future__ import annotations

import os

import torch

from kernels.lazy_jit import LazyKernel

try:  # Triton is optional at import time (the torch reference always works).
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton ships with torch on Linux
    HAVE_TRITON = False

COPY_BLOCK_ELEMS = 4096
"""Elements (of the word dtype) a Triton program copies per iteration: a whole 32 KiB segment of
int64 words at Llama-3-8B shapes (page 16), so each thread has 16 loads of 16 bytes in flight
over PCIe. Interleaved A/B on an H200 (``benchmarks/results/gpu/probes/copy-ab-run11-*``, three
rounds, block-first pool, layer-strided segments): H2D 0.898 of a contiguous copy vs 0.883 at
1024, H2D + D2H 1.29x vs 1.19x one direction; the H100 sweep of run 10 agrees (0.882 / 1.29x)."""
LOOP_COPY_MIN_BYTES = 16384
"""CPU reference: segments at least this large are copied row by row (no temporary)."""


def _check(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
    if src.dim() != 2 or dst.dim() != 2:
        raise ValueError(f"src and dst must be 2-D segment views, got {src.dim()}-D and {dst.dim()}-D")
    if src.shape[1] != dst.shape[1]:
        raise ValueError(f"segment sizes differ: src {src.shape[1]} vs dst {dst.shape[1]} elements")
    if src.dtype != dst.dtype:
        raise ValueError(f"dtypes differ: src {src.dtype} vs dst {dst.dtype}")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("src and dst must be contiguous")
    if src_idx.shape != dst_idx.shape or src_idx.dim() != 1:
        raise ValueError(
            f"src_idx and dst_idx must be 1-D of equal length, got {tuple(src_idx.shape)} "
            f"and {tuple(dst_idx.shape)}"
        )


def copy_segments_ref(
    src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor
) -> None:
    """Torch reference: ``dst[dst_idx] = src[src_idx]`` (indices may live on any device)."""
    _check(src, dst, src_idx, dst_idx)
    if src_idx.numel() == 0:
        return
    if src.shape[1] * src.element_size() >= LOOP_COPY_MIN_BYTES and not (src.is_cuda or dst.is_cuda):
        # Large host segments: row copies avoid index_select's temporary (page faults dominate).
        for s, d in zip(src_idx.tolist(), dst_idx.tolist(), strict=True):
            dst[d].copy_(src[s])
        return
    rows = src.index_select(0, src_idx.to(src.device, torch.long))
    dst.index_copy_(0, dst_idx.to(dst.device, torch.long), rows.to(dst.device))


def word_view(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret a contiguous 2-D tensor as the widest integer words that divide a row; ``t``
    itself when it already is that view (a caller that launches on the same pools every step
    keeps their word views, :class:`~sglang_ext.dataplane.cuda_transfer_engine.CudaTransferEngine`:
    two tensor views fewer per pool and launch on the scheduler thread)."""
    row_bytes = t.shape[1] * t.element_size()
    for word in (torch.int64, torch.int32, torch.int16):
        if row_bytes % word.itemsize == 0:  # no tensor to ask: this runs at every launch
            if t.dtype == word:
                return t
            return t.view(torch.uint8).view(word) if t.dtype != torch.uint8 else t.view(word)
    return t.view(torch.uint8)


if HAVE_TRITON:

    def _copy_segments_kernel(
        src_ptr,
        dst_ptr,
        src_idx_ptr,
        dst_idx_ptr,
        n,
        n_ptr,
        programs,
        SEG: tl.constexpr,
        BLOCK: tl.constexpr,
        COUNTED: tl.constexpr,
    ):
        if COUNTED:  # the count lives in device memory (a CUDA graph's launch: copy_segments_triton)
            n = tl.load(n_ptr)
        # persistent: ``programs`` programs stride over the pairs, each copying a whole segment in
        # BLOCK chunks; few, so the layers' kernels and a copy in the other direction find SMs
        # free (see DEFAULT_PROGRAMS)
        for pair in range(tl.program_id(0), n, programs):
            s = tl.load(src_idx_ptr + pair).to(tl.int64)
            d = tl.load(dst_idx_ptr + pair).to(tl.int64)
            for start in range(0, SEG, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < SEG
                x = tl.load(src_ptr + s * SEG + offs, mask=mask)
                tl.store(dst_ptr + d * SEG + offs, x, mask=mask)

    def _fetch_pages_kernel(
        host_ptr,
        dev_ptr,
        flat_ptr,
        stage_ptr,
        map_row_ptr,
        reqs_ptr,
        starts_ptr,
        counts_ptr,
        work,
        host_base,
        host_stride,
        dev_v,
        max_pages,
        programs,
        listed_ptr,
        SEG: tl.constexpr,
        BLOCK: tl.constexpr,
        LISTED: tl.constexpr,
    ):
        # max_pages and programs are runtime values (constexprs would compile a kernel per shape)
        if LISTED:  # requests and extent in device memory (a CUDA graph's launch: fetch_pages_triton)
            max_pages = tl.load(listed_ptr + 1)
            work = tl.load(listed_ptr) * max_pages
        # item = (request i of the launch, its page j): page j of request reqs[i] is column
        # starts[r] + j of the step; copied (K then V segment) when the map has no device copy of
        # it at this layer, from host segment host_base + page * host_stride (+1 for V) to the
        # column's staging page (V at + dev_v)
        for item in range(tl.program_id(0), work, programs):
            i = item // max_pages
            j = item % max_pages
            r = tl.load(reqs_ptr + i)
            inside = j < tl.load(counts_ptr + r)
            col = tl.load(starts_ptr + r) + j
            page = tl.load(flat_ptr + col, mask=inside, other=0).to(tl.int64)
            on_host = inside & (tl.load(map_row_ptr + page, mask=inside, other=0) < 0)
            d = tl.load(stage_ptr + col, mask=on_host, other=0).to(tl.int64)
            on_host = on_host & (d >= 0)  # a negative entry reads a page another column fetches
            s = host_base + page * host_stride
            for start in range(0, SEG, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = (offs < SEG) & on_host
                k = tl.load(host_ptr + s * SEG + offs, mask=mask)
                tl.store(dev_ptr + d * SEG + offs, k, mask=mask)
                v = tl.load(host_ptr + (s + 1) * SEG + offs, mask=mask)
                tl.store(dev_ptr + (d + dev_v) * SEG + offs, v, mask=mask)

    # sizes and index views vary per launch: specialising on their values or alignment would
    # compile a kernel per step shape in the middle of serving
    _copy_segments_kernel = LazyKernel(
        _copy_segments_kernel, do_not_specialize=["n", "programs"],
        do_not_specialize_on_alignment=["src_idx_ptr", "dst_idx_ptr", "n_ptr"])
    _fetch_pages_kernel = LazyKernel(
        _fetch_pages_kernel,
        do_not_specialize=["work", "host_base", "host_stride", "dev_v", "max_pages", "programs"],
        do_not_specialize_on_alignment=["flat_ptr", "stage_ptr", "map_row_ptr", "reqs_ptr", "starts_ptr",
                                        "counts_ptr", "listed_ptr"])

DEFAULT_PROGRAMS = 8
"""Persistent programs of one copy launch on CUDA (``--kv-copy-programs N`` sets another). Few
on purpose: a copy program holds its SM for the whole copy (89 registers a thread for the fetch,
``benchmarks/results/gpu/probes/kernel-regs-*``), and the layers' kernels a fetch should overlap
cannot start on an SM it holds. Through session 23 the default was 2 per SM (264 on an H200),
tuned for duplex (H2D + D2H together 1.35-1.45x one direction); then on H200s (runs 14-16,
``benchmarks/results/gpu/session23-h200-runs.md``) a placement whose fetches the model hides
stepped 22.0 / 22.4 / 25.2 ms at 2 per SM against 18.2 / 16.5 / 17.5 ms at 8 (all-resident:
12.9 / 12.9 / 15.0 ms), with H2D at 47.5-48.4 GB/s either way and the transfer-bound
half-offloaded step equal (235.4 vs 236.2 ms). The price: duplex ~1.17x."""
COPY_WARPS = 4
"""Warps per copy program (8 won the synthetic sweep; 4 the engine-level one on a gpu-check-sized block-first pool, layer-strided: duplex 1.30x vs 1.27x)."""
INTERPRETER_PROGRAMS = 3


def programs_for(t: torch.Tensor, work: int, programs: int | None = None) -> int:
    """Programs of a persistent copy launch on ``t``'s device for ``work`` items: ``programs``
    when given (``--kv-copy-programs``, ``gpu-check``'s overlap sweep), else
    :data:`DEFAULT_PROGRAMS` (the interpreter: :data:`INTERPRETER_PROGRAMS`)."""
    if programs is not None and programs < 1:
        raise ValueError(f"programs={programs}, must be >= 1 (or None: {DEFAULT_PROGRAMS})")
    if programs is None:
        programs = DEFAULT_PROGRAMS if t.is_cuda else INTERPRETER_PROGRAMS
    return max(1, min(work, programs))


def copy_segments_triton(
    src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor,
    programs: int | None = None, count: torch.Tensor | None = None,
) -> None:
    """Triton gather/scatter: one launch for all pairs. Indices must be on the kernel's device.
    ``programs``: the launch's persistent programs (:func:`programs_for`). ``count``: a one-element
    int32 tensor on the kernel's device holding how many of the index pairs to copy (at most
    their length), read by the kernel: a launch a CUDA graph replays over other lists (none: all)."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not importable; use copy_segments_ref")
    _check(src, dst, src_idx, dst_idx)
    n = src_idx.numel()
    if n == 0:
        return
    s_words = word_view(src)
    d_words = word_view(dst)
    seg = s_words.shape[1]
    block = min(COPY_BLOCK_ELEMS, triton.next_power_of_2(seg))
    programs = programs_for(src if src.is_cuda else dst, n, programs)
    # n and programs are runtime values: constexprs would compile a kernel per launch size
    _copy_segments_kernel[(programs,)](s_words, d_words, src_idx, dst_idx, n, src_idx if count is None else count,
                                       programs, SEG=seg, BLOCK=block, COUNTED=count is not None,
                                       num_warps=COPY_WARPS)


def fetch_pages_triton(host: torch.Tensor, dev: torch.Tensor, flat: torch.Tensor, stage: torch.Tensor,
                       map_row: torch.Tensor, reqs: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                       max_pages: int, host_base: int, host_stride: int, dev_v: int,
                       programs: int | None = None, listed: torch.Tensor | None = None) -> None:
    """One launch: for each request ``r`` of ``reqs`` and each of its ``counts[r]`` pages
    (column ``c = starts[r] + j``, page ``flat[c]``) with ``map_row[page] < 0`` and
    ``stage[c] >= 0``, copy host segments ``host_base + page * host_stride`` (K) and ``+ 1`` (V)
    to device segments ``stage[c]`` and ``stage[c] + dev_v`` (a negative ``stage[c]``: the
    column reads a page another column fetches, ``sglang_ext/dataplane/staging_columns.py``).
    ``max_pages >= max(counts[reqs])``. Pools are 2-D segment views (pinned host, device); index tensors int32 or int64 on the kernel's device.
    ``programs``: the launch's persistent programs (:func:`programs_for`). ``listed``: two int32
    on the kernel's device, how many of ``reqs`` the launch copies and their ``max_pages``, read by
    the kernel (then ``max_pages`` here bounds those and sizes the launch): a launch a CUDA graph
    replays over other lists (:class:`~sglang_ext.dataplane.graph_staging.GraphStaging`).
    The host works out nothing per page: see :func:`fetch_page_indices` for the same copy as index lists."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not importable")
    if host.dtype != dev.dtype or host.shape[1] != dev.shape[1]:
        raise ValueError("fetch_pages_triton: host and device pools must share dtype and segment size")
    n = reqs.numel()
    if n == 0 or max_pages == 0:
        return
    h_words, d_words = word_view(host), word_view(dev)
    seg = h_words.shape[1]
    block = min(COPY_BLOCK_ELEMS, triton.next_power_of_2(seg))
    work = n * max_pages
    programs = programs_for(dev, work, programs)
    _fetch_pages_kernel[(programs,)](h_words, d_words, flat, stage, map_row, reqs, starts, counts, work,
                                     host_base, host_stride, dev_v, max_pages, programs,
                                     reqs if listed is None else listed, SEG=seg, BLOCK=block,
                                     LISTED=listed is not None, num_warps=COPY_WARPS)


def fetch_page_indices(flat, stage, map_row, reqs, starts, counts,  # noqa: ANN001 - NumPy arrays
                       host_base: int, host_stride: int, dev_v: int):  # noqa: ANN201
    """:func:`fetch_pages_triton`'s copy as ``(src, dst)`` segment lists (NumPy int64: K
    segments, then V segments), for the CPU engine and as the kernel's reference."""
    cols, pages = fetch_page_columns(flat, reqs, starts, counts)
    return fetch_segments(stage, cols, pages, host_only_mask(map_row, pages), host_base, host_stride, dev_v)


def fetch_page_columns(flat, reqs, starts, counts):  # noqa: ANN001, ANN201 - NumPy arrays
    """The part of :func:`fetch_page_indices` no layer changes: ``(cols, pages)``, the columns of
    the step's page lists that requests ``reqs`` hold, and their pages (NumPy int64)."""
    import numpy as np

    reqs = np.asarray(reqs, dtype=np.int64)
    cnt = np.asarray(counts, dtype=np.int64)[reqs]
    first = np.cumsum(cnt) - cnt
    cols = np.arange(int(cnt.sum())) + np.repeat(np.asarray(starts, dtype=np.int64)[reqs] - first, cnt)
    return cols, np.asarray(flat, dtype=np.int64)[cols]


def host_only_mask(map_row, pages):  # noqa: ANN001, ANN201 - NumPy arrays
    """Which of ``pages`` are host-only at the layer of ``map_row`` (the map's row: -1 there)."""
    import numpy as np

    return np.asarray(map_row)[pages] < 0


def fetch_segments(stage, cols, pages, keep, host_base: int, host_stride: int, dev_v: int):  # noqa: ANN001, ANN201
    """:func:`fetch_page_indices` from :func:`fetch_page_columns`' ``(cols, pages)`` and the
    layer's host-only mask ``keep`` of them: K segments, then V. Columns whose ``stage`` entry is
    negative copy nothing (another column fetches their page)."""
    import numpy as np

    stage = np.asarray(stage, dtype=np.int64)
    keep = keep & (stage[cols] >= 0)
    cols, pages = cols[keep], pages[keep]
    k = host_base + pages * host_stride
    d = stage[cols]
    return np.concatenate([k, k + 1]), np.concatenate([d, d + dev_v])


def triton_usable(*tensors: torch.Tensor) -> bool:
    """Triton can run here: on CUDA (any tensor on a GPU) or on CPU under TRITON_INTERPRET=1."""
    if not HAVE_TRITON:
        return False
    if any(t.is_cuda for t in tensors):
        return True
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def copy_segments(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    impl: str = "auto",
    programs: int | None = None,
) -> None:
    """``dst[dst_idx[i]] = src[src_idx[i]]``; impl is ``auto`` (Triton where usable), ``triton``
    or ``torch``; ``programs``: the Triton launch's persistent programs (:func:`programs_for`)."""
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be one of auto, triton, torch; got {impl!r}")
    if impl == "torch" or (impl == "auto" and not triton_usable(src, dst)):
        copy_segments_ref(src, dst, src_idx, dst_idx)
    else:
        copy_segments_triton(src, dst, src_idx, dst_idx, programs)
