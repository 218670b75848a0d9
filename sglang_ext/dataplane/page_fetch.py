"""PageFetch: one batched fetch of a paged step, described by requests instead of page lists.

A :class:`~sglang_ext.dataplane.paged_step_tables.PagedStepTables` fetch moves, at one layer, the
host-only pages of some of the batch's requests into their staging pages. Listing those pages
on the host costs ``O(pages)`` per step (164K layer-pages at Llama-3-8B shapes, batch 32,
half offloaded). A PageFetch instead names the requests; on CUDA one Triton launch
(:func:`kernels.block_copy.fetch_pages_triton`) reads each request's pages from the step's
uploaded tables and the map mirror's row and copies those with no device copy. The same copy as
index lists (:meth:`indices`) runs the CPU engine and the per-segment fallback, and is the
kernel's reference in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.block_copy import (
    fetch_page_columns,
    fetch_page_indices,
    fetch_pages_triton,
    fetch_segments,
    host_only_mask,
)


@dataclass(frozen=True)
class PageFetch:
    """Everything one fetch launch reads (device tensors are views of the step's upload)."""

    layer: int
    layers: int
    """L (host segments of page ``p`` at ``layer``: ``(p * L + layer) * 2``, V ``+ 1``)."""
    dev_v: int
    """Device segments of V start here (the pool's page count)."""
    max_pages: int
    """Most pages of one request of the launch (the kernel's page extent)."""
    segments: int
    """Segments it copies (2 per host-only layer-page of its requests)."""
    reqs: torch.Tensor
    flat: torch.Tensor
    stage: torch.Tensor
    starts: torch.Tensor
    counts: torch.Tensor
    map_row: torch.Tensor
    """The mirror's row of ``layer`` (device)."""
    host_arrays: tuple[np.ndarray, ...]
    """``(reqs, flat, stage, starts, counts, map_row)`` in host memory (the index lists)."""

    def indices(self) -> tuple[np.ndarray, np.ndarray]:
        """``(src, dst)`` segments of the copy (NumPy int64, K then V)."""
        reqs, flat, stage, starts, counts, map_row = self.host_arrays
        return fetch_page_indices(flat, stage, map_row, reqs, starts, counts, 2 * self.layer, 2 * self.layers,
                                  self.dev_v)

    def columns(self) -> tuple[np.ndarray, np.ndarray]:
        """``(cols, pages)``: the columns of the step's page lists its requests hold and their
        pages -- :meth:`indices` before the layer's map row decides which to copy (the same for
        every fetch of these requests in one step)."""
        reqs, flat, _, starts, counts, _ = self.host_arrays
        return fetch_page_columns(flat, reqs, starts, counts)

    def host_only(self, pages: np.ndarray) -> np.ndarray:
        """Which of ``pages`` are host-only at this fetch's layer (those it copies)."""
        return host_only_mask(self.host_arrays[5], pages)

    def segment_lists(self, cols: np.ndarray, pages: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`indices` from :meth:`columns` and :meth:`host_only`'s ``keep``."""
        return fetch_segments(self.host_arrays[2], cols, pages, keep, 2 * self.layer, 2 * self.layers, self.dev_v)

    def run_triton(self, host: torch.Tensor, dev: torch.Tensor, programs: int | None = None) -> None:
        """The copy as one Triton launch on the current stream (CUDA) of ``programs`` persistent
        programs (None: the kernel's default)."""
        fetch_pages_triton(host, dev, self.flat, self.stage, self.map_row, self.reqs, self.starts, self.counts,
                           self.max_pages, 2 * self.layer, 2 * self.layers, self.dev_v, programs)
