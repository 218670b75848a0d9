"""LayerView: one layer of a step as paged attention kernels take it (FlashInfer's CSR form)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
