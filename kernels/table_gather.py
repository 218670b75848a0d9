"""Per-layer page tables gathered on the device from the map mirror, inside a CUDA graph.

A paged decode step's page table is ``tab[l, c] = map[l, flat[c]]`` where the layer-page is
resident, else the column's staging page (``stage[c]``; a reader column's entry is encoded
``-2 - s``, ``sglang_ext/dataplane/staging_columns.py``). Graph-replayed steps gather it where the
graph reads it (:class:`~sglang_ext.dataplane.graph_step_buffers.GraphStepBuffers`), so the
host sends the step's ``2n`` page and staging entries and no ``[L, n]`` table, and dispatches no
gather of its own. A column whose page is ``-1`` takes its staging entry at every layer: a padded
row's column on the sink page.

:func:`gather_tables_triton` reads how many columns are in use from device memory (``bound``: the
padded batch's last ``kv_indptr``), so one captured launch serves every step and does
``L x n`` work, not ``L x`` the buffers' width. Its programs per layer are capped
(:data:`GATHER_PROGRAMS`, each looping over every such program's block): a grid over the width
launched ~60K programs a replay at 2M page columns, nearly all reading the bound and exiting
(found by review in session 86). :func:`gather_tables_ref` is the same in torch
ops over the whole width (the CPU's, and the kernel's reference).
"""

from __future__ import annotations

import torch

from kernels.block_copy import HAVE_TRITON
from kernels.lazy_jit import LazyKernel

if HAVE_TRITON:
    import triton
    import triton.language as tl

GATHER_BLOCK = 1024
"""Columns a program gathers at a time (one layer's)."""

GATHER_PROGRAMS = 32
"""Programs per layer at most; a program gathers blocks ``pid, pid + GATHER_PROGRAMS, ...`` below
the bound (32 layers x 32 programs: ~1K programs, every SM busy while the gather is wide)."""


def _check(mirror: torch.Tensor, flat: torch.Tensor, stage: torch.Tensor, tab: torch.Tensor) -> None:
    if mirror.dim() != 2 or tab.dim() != 2 or mirror.shape[0] != tab.shape[0]:
        raise ValueError(f"gather_tables: mirror [L, P] and tab [L, W] must share L; got {tuple(mirror.shape)} "
                         f"and {tuple(tab.shape)}")
    if flat.shape != (tab.shape[1],) or stage.shape != (tab.shape[1],):
        raise ValueError(f"gather_tables: flat and stage must be [W={tab.shape[1]}]; got {tuple(flat.shape)} and "
                         f"{tuple(stage.shape)}")
    if not (mirror.is_contiguous() and tab.is_contiguous()):
        raise ValueError("gather_tables: mirror and tab must be contiguous")


def gather_tables_ref(mirror: torch.Tensor, flat: torch.Tensor, stage: torch.Tensor, tab: torch.Tensor) -> None:
    """``tab[l, c] = mirror[l, flat[c]]`` if that is ``>= 0`` and ``flat[c] >= 0``, else the
    decoded ``stage[c]``, over every column (entries of ``flat`` past the mirror's width are
    clamped: unused columns hold whatever an earlier step left)."""
    _check(mirror, flat, stage, tab)
    pages = flat.clamp(0, mirror.shape[1] - 1)
    g = mirror.index_select(1, pages)
    s = torch.where(stage >= 0, stage, -2 - stage)
    tab.copy_(torch.where((g >= 0) & (flat >= 0)[None, :], g, s[None, :]))


def _gather_tables_kernel(mirror, flat, stage, tab, bound, P, W, BLOCK: tl.constexpr):  # noqa: ANN001, N803
    layer = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.load(bound), W)  # a bound past the table's width writes nothing past it
    for start in range(tl.program_id(1) * BLOCK, n, tl.num_programs(1) * BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = cols < n
        p = tl.load(flat + cols, mask=m, other=-1)
        s = tl.load(stage + cols, mask=m, other=-1)
        s = tl.where(s >= 0, s, -2 - s)
        ok = m & (p >= 0) & (p < P)
        g = tl.load(mirror + layer * P + p, mask=ok, other=-1)
        tl.store(tab + layer * W + cols, tl.where(g >= 0, g, s), mask=m)


_gather_kernel = LazyKernel(_gather_tables_kernel)


def gather_tables_triton(mirror: torch.Tensor, flat: torch.Tensor, stage: torch.Tensor, tab: torch.Tensor,
                         bound: torch.Tensor, block: int = GATHER_BLOCK, programs: int = GATHER_PROGRAMS) -> None:
    """:func:`gather_tables_ref` in one launch over the first ``bound[0]`` columns only (a
    one-element int32 tensor on the kernel's device, read by the kernel: no host sync), at most
    ``programs`` programs a layer of ``block`` columns each (a power of two)."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not importable; use gather_tables_ref")
    _check(mirror, flat, stage, tab)
    layers, width = tab.shape
    if not layers or not width:
        return
    grid = (layers, min(triton.cdiv(width, block), programs))
    _gather_kernel[grid](mirror, flat, stage, tab, bound, mirror.shape[1], width, BLOCK=block)
