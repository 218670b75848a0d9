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

COPY_BLOCK_ELEMS = 1024
"""Elements (of the word dtype) each Triton program copies."""
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


def _word_view(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret a contiguous 2-D tensor as the widest integer words that divide a row."""
    row_bytes = t.shape[1] * t.element_size()
    for word in (torch.int64, torch.int32, torch.int16):
        size = torch.empty((), dtype=word).element_size()
        if row_bytes % size == 0:
            return t.view(torch.uint8).view(word) if t.dtype != torch.uint8 else t.view(word)
    return t.view(torch.uint8)


if HAVE_TRITON:

    def _copy_segments_kernel(
        src_ptr,
        dst_ptr,
        src_idx_ptr,
        dst_idx_ptr,
        SEG: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pair = tl.program_id(0)
        chunk = tl.program_id(1)
        s = tl.load(src_idx_ptr + pair).to(tl.int64)
        d = tl.load(dst_idx_ptr + pair).to(tl.int64)
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < SEG
        x = tl.load(src_ptr + s * SEG + offs, mask=mask)
        tl.store(dst_ptr + d * SEG + offs, x, mask=mask)


    _copy_segments_kernel = LazyKernel(_copy_segments_kernel)

def copy_segments_triton(
    src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor
) -> None:
    """Triton gather/scatter: one launch for all pairs. Indices must be on the kernel's device."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not importable; use copy_segments_ref")
    _check(src, dst, src_idx, dst_idx)
    n = src_idx.numel()
    if n == 0:
        return
    s_words = _word_view(src)
    d_words = _word_view(dst)
    seg = s_words.shape[1]
    block = min(COPY_BLOCK_ELEMS, triton.next_power_of_2(seg))
    grid = (n, triton.cdiv(seg, block))
    _copy_segments_kernel[grid](s_words, d_words, src_idx, dst_idx, SEG=seg, BLOCK=block)


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
) -> None:
    """``dst[dst_idx[i]] = src[src_idx[i]]``; impl is ``auto`` (Triton where usable), ``triton``
    or ``torch``."""
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be one of auto, triton, torch; got {impl!r}")
    if impl == "torch" or (impl == "auto" and not triton_usable(src, dst)):
        copy_segments_ref(src, dst, src_idx, dst_idx)
    else:
        copy_segments_triton(src, dst, src_idx, dst_idx)
