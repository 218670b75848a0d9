"""at_rest_batch: what an overflow step reads at rest, each slot once, and each request's view of it.

A step whose staging does not fit the device budget is served at rest (``LayeredKVCore.overflow``):
each layer's K/V of the batch's slots is read into a tensor outside the device pool, and the
attention reads it through a compact table (request ``i``'s row: where its tokens sit in that
tensor). The batch's slots used to be every request's slots concatenated, so a prefix shared by
many requests (SGLang's radix cache) was read once per request. Reading distinct slots bounds
each layer's read by one layer of the slot space, which the launch check keeps within the device
pool. (Shared prefixes no longer make a batch overflow by themselves: staging takes one page a
distinct page, :mod:`~sglang_ext.dataplane.staging_columns`.) SGLang-free.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def at_rest_batch(per_req: Sequence[torch.Tensor], lens: Sequence[int],
                  device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slots, table)``: the distinct slots of ``per_req`` (request ``i``'s first ``lens[i]``
    are its tokens'), ascending, and the ``[B, max(lens)]`` int64 table on ``device`` whose row
    ``i`` holds the positions in ``slots`` of request ``i``'s tokens in order (0 past its length).
    ``slots[table[i, :lens[i]]]`` equals ``per_req[i][:lens[i]]``. On a GPU ``unique`` reads its
    size back: the overflow boundary's, never a layer's."""
    width = max(lens, default=1) or 1
    if not per_req or not sum(lens):
        return torch.zeros(0, dtype=torch.int64), torch.zeros((len(lens), width), dtype=torch.int64, device=device)
    every = torch.cat([s[:n] for s, n in zip(per_req, lens, strict=True)]).to(torch.int64)
    slots, inverse = torch.unique(every, return_inverse=True)
    lens_t = torch.tensor(list(lens), dtype=torch.int64, device=inverse.device)
    starts = torch.cumsum(lens_t, 0) - lens_t
    cols = torch.arange(width, dtype=torch.int64, device=inverse.device)
    inside = cols[None, :] < lens_t[:, None]
    at = torch.where(inside, starts[:, None] + cols[None, :], 0)
    table = torch.where(inside, inverse[at], 0)
    return slots, table.to(device)
