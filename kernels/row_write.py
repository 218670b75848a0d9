"""Row write: a layer's new K and V rows into their device rows in ONE launch.

``write_rows_triton(k_dst, v_dst, rows, k, v)`` does ``k_dst[rows[i]] = k[i]`` and
``v_dst[rows[i]] = v[i]`` for every ``i``: what the layered core's KV write is, one program per
row, K and V together. Without it the core writes with two ``index_copy_`` launches a layer (64
at 32 layers), which on an eager GPU step is host time: ``kvplane gpu-check`` run 24 (H200)
profiled SGLang-free ``index_copy_`` at 1.64 ms of the hidden step's host time (65 calls). The
SGLang adapter writes with SGLang's own ``store_cache`` kernel where it can build it
(``sglang_ext/store_cache_writer.py``); this kernel serves where it cannot and where SGLang is
absent (``kvplane gpu-check``'s host).

Destinations are ``[R, H, D]`` with contiguous rows (the flat page pool, an identity layer in
place, a park buffer); sources ``[n, H, D]`` whose rows may be strided (a slice of a fused QKV
projection: each row's ``H * D`` elements contiguous, rows apart by ``stride(0)``). ``ROW`` and
the block are constexprs (one compile per model width); the row count is the grid (a CUDA graph
captures one per batch size, as SGLang captures its graphs). On CPU the kernel runs only under
``TRITON_INTERPRET=1``; :func:`write_rows_ref` is the reference.
"""

from __future__ import annotations

import torch

from kernels.lazy_jit import LazyKernel

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton ships with torch on Linux
    HAVE_TRITON = False

MAX_BLOCK = 4096
"""Largest chunk of a row one iteration moves (elements)."""


def write_rows_ref(k_dst: torch.Tensor, v_dst: torch.Tensor, rows: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> None:
    """The reference: two ``index_copy_``."""
    k_dst.index_copy_(0, rows, k)
    v_dst.index_copy_(0, rows, v)


def rows_contiguous(t: torch.Tensor) -> bool:
    """``t`` is ``[n, H, D]`` with each row's ``H * D`` elements contiguous."""
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


if HAVE_TRITON:

    def _write_rows_kernel(k_dst, v_dst, rows_ptr, k_src, v_src, k_stride, v_stride, ROW: tl.constexpr,
                           BLOCK: tl.constexpr):
        i = tl.program_id(0)
        r = tl.load(rows_ptr + i).to(tl.int64)
        ik = i.to(tl.int64) * k_stride
        iv = i.to(tl.int64) * v_stride
        for start in range(0, ROW, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < ROW
            tl.store(k_dst + r * ROW + offs, tl.load(k_src + ik + offs, mask=mask), mask=mask)
            tl.store(v_dst + r * ROW + offs, tl.load(v_src + iv + offs, mask=mask), mask=mask)

    # the sources' row strides vary with the caller (a fused projection's slice, a contiguous copy)
    _write_rows_kernel = LazyKernel(_write_rows_kernel, do_not_specialize=["k_stride", "v_stride"],
                                    do_not_specialize_on_alignment=["rows_ptr"])


def write_rows_triton(k_dst: torch.Tensor, v_dst: torch.Tensor, rows: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> None:
    """``k_dst[rows] = k``, ``v_dst[rows] = v`` in one launch (module docstring). ``rows``: int32
    or int64 on the kernel's device; every tensor of one dtype; ValueError otherwise."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not importable; use write_rows_ref")
    n = rows.numel()
    if k.shape[0] != n or v.shape[0] != n or k.shape[1:] != k_dst.shape[1:] or v.shape[1:] != v_dst.shape[1:]:
        raise ValueError(f"write_rows_triton: {n} rows, sources {tuple(k.shape)} / {tuple(v.shape)}, destinations "
                         f"{tuple(k_dst.shape)} / {tuple(v_dst.shape)}")
    if len({k_dst.dtype, v_dst.dtype, k.dtype, v.dtype}) != 1:
        raise ValueError("write_rows_triton: sources and destinations must share one dtype")
    if not all(rows_contiguous(t) for t in (k_dst, v_dst, k, v)) or k_dst.stride(0) != v_dst.stride(0):
        raise ValueError("write_rows_triton: every row's H * D elements must be contiguous, the destinations' "
                         "rows dense")
    if n == 0:
        return
    row = k.shape[1] * k.shape[2]
    if k_dst.stride(0) != row:
        raise ValueError(f"write_rows_triton: destination rows {k_dst.stride(0)} elements apart, expected {row}")
    _write_rows_kernel[(n,)](k_dst, v_dst, rows, k, v, k.stride(0), v.stride(0), ROW=row,
                             BLOCK=min(MAX_BLOCK, triton.next_power_of_2(row)))
