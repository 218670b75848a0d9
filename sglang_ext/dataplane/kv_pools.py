"""DevicePool and HostPool: the two KV stores and their segment addressing.

Device pool: one flattened pool shared by all layers (OrbitFlow §4, Fig. 6): ``kv[2, N, bs, H, D]``
with ``k_cache = kv[0]`` and ``v_cache = kv[1]`` (FlashInfer NHD paged layout). Any block can hold
any layer of any request, so dropping one layer of one request frees blocks everybody can use.

Host pool: block-first (SuperInfer §4.3.2): ``kv[HB, L, 2, bs, H, D]``; one request-block of all
layers is one contiguous region, so moving a request-block is one large copy.

Both are also viewed as ``[num_segments, segment_elems]`` for the batched copy kernel; a segment is
the K (or V) of one layer-block.
"""

from __future__ import annotations

import torch

from sglang_ext.dataplane.block_allocator import BlockAllocator
from sglang_ext.dataplane.config import LayeredKVConfig


class DevicePool:
    """Device blocks (one layer of one request-block each) and their allocator."""

    def __init__(self, config: LayeredKVConfig) -> None:
        c = config
        self.num_blocks = c.device_blocks
        self.kv = torch.zeros(
            (2, c.device_blocks, c.block_size, c.kv_heads, c.head_dim), dtype=c.dtype, device=c.device
        )
        self.k_cache = self.kv[0]
        """``[N, block_size, kv_heads, head_dim]`` keys of every device block."""
        self.v_cache = self.kv[1]
        """``[N, block_size, kv_heads, head_dim]`` values of every device block."""
        self.segments = self.kv.view(2 * c.device_blocks, c.segment_elems)
        self.allocator = BlockAllocator(c.device_blocks, "device pool")

    def segs(self, blocks: list[int]) -> list[int]:
        """Segment ids (K then V) of each device block, interleaved: [k0, v0, k1, v1, ...]."""
        out: list[int] = []
        n = self.num_blocks
        for d in blocks:
            out += (d, n + d)
        return out


class HostPool:
    """Host request-blocks (all layers each), pinned on CUDA, and their allocator."""

    def __init__(self, config: LayeredKVConfig) -> None:
        c = config
        self.layers = c.layers
        self.kv = torch.zeros(
            (c.host_blocks, c.layers, 2, c.block_size, c.kv_heads, c.head_dim),
            dtype=c.dtype,
            pin_memory=c.is_cuda,
        )
        self.segments = self.kv.view(c.host_blocks * c.layers * 2, c.segment_elems)
        self.allocator = BlockAllocator(c.host_blocks, "host pool")

    def segs(self, blocks: list[int], layer: int) -> list[int]:
        """Segment ids (K then V) of ``layer`` in each host block: [k0, v0, k1, v1, ...]."""
        out: list[int] = []
        base_l = self.layers
        for hb in blocks:
            k = (hb * base_l + layer) * 2
            out += (k, k + 1)
        return out
