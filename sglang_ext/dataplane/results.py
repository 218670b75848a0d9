"""Frozen results returned by :class:`LayeredKVCache`."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AppendResult:
    """Where the model writes the KV of newly appended tokens."""

    rid: str
    """Request id."""
    start_token: int
    """Position of the first appended token."""
    locs: torch.Tensor
    """``[layers, n]`` int64 token slots into ``k_cache.view(-1, H, D)`` per layer. Offloaded
    layers point into the staging slot; write them between ``wait_layer(l)`` and ``end_layer(l)``."""


@dataclass(frozen=True)
class LayerView:
    """Everything paged attention needs for one layer of the current step."""

    layer: int
    """Layer index."""
    k_cache: torch.Tensor
    """``[N, block_size, kv_heads, head_dim]``: the shared device pool's keys."""
    v_cache: torch.Tensor
    """``[N, block_size, kv_heads, head_dim]``: the shared device pool's values."""
    kv_indptr: torch.Tensor
    """``[B+1]`` int32 CSR offsets into ``kv_indices`` (identical for every layer)."""
    kv_indices: torch.Tensor
    """``[sum b_r]`` int32 device pages of this layer (resident blocks or staging)."""
    kv_lens: torch.Tensor
    """``[B]`` int32 tokens per request."""
    last_page_len: torch.Tensor
    """``[B]`` int32 tokens in each request's last page (FlashInfer)."""
    rids: tuple[str, ...]
    """Request ids in batch order."""


@dataclass(frozen=True)
class MemoryUsage:
    """Device blocks by role; ``resident + staging`` is what the placement model accounts."""

    resident_blocks: int
    """Blocks of resident layers of active requests."""
    staging_blocks: int
    """Staging slots of active requests that offload something."""
    removable_blocks: int
    """Blocks still held by paused requests (reclaimed lazily, highest layer first)."""
    free_blocks: int
    """Unallocated device blocks."""
    capacity_blocks: int
    """Device pool size."""


@dataclass(frozen=True)
class InstallReport:
    """What installing a placement (or resuming) moved."""

    offloaded_layers: int
    """(request, layer) pairs moved to host memory."""
    onloaded_layers: int
    """(request, layer) pairs fetched to the device."""
    d2h_blocks: int
    """Layer-blocks written back device -> host (dirty tails and unsynced blocks only)."""
    h2d_blocks: int
    """Layer-blocks copied host -> device."""
    reclaimed_layers: int
    """Layers dropped from paused requests to make room."""
