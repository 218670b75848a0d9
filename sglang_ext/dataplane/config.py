"""LayeredKVConfig: shape and sizes of the layered KV cache (one frozen dataclass)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class LayeredKVConfig:
    """Pools are sized here; a *block* is one layer of one request-block (K and V)."""

    layers: int
    """Transformer layers L (1..4096)."""
    block_size: int
    """Tokens per block (page), 1..4096."""
    kv_heads: int
    """KV heads per layer on this rank (>= 1)."""
    head_dim: int
    """Head dimension of K and V (>= 1)."""
    device_blocks: int
    """Device pool capacity in blocks (the GPU KV budget: resident + staging + removable)."""
    host_pool_gb: float
    """Host pool size in GB (1e9 bytes); pinned on CUDA. Must hold at least one request-block."""
    dtype: torch.dtype = torch.float16
    """KV dtype: float32, float16 or bfloat16."""
    device: str = "cpu"
    """``cpu`` or ``cuda`` / ``cuda:N``."""

    def __post_init__(self) -> None:
        for name, lo, hi in (
            ("layers", 1, 4096),
            ("block_size", 1, 4096),
            ("kv_heads", 1, 1 << 16),
            ("head_dim", 1, 1 << 16),
            ("device_blocks", 1, 1 << 40),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"LayeredKVConfig.{name} = {value!r} out of range [{lo}, {hi}]")
        if self.dtype not in _DTYPES:
            raise ValueError(f"LayeredKVConfig.dtype = {self.dtype} not in {list(_DTYPES)}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"LayeredKVConfig.device = {self.device!r}; allowed: cpu, cuda[:N]")
        if not isinstance(self.host_pool_gb, int | float) or self.host_pool_gb <= 0:
            raise ValueError(f"LayeredKVConfig.host_pool_gb = {self.host_pool_gb!r} must be > 0")
        if self.host_blocks < 1:
            raise ValueError(
                f"LayeredKVConfig.host_pool_gb = {self.host_pool_gb} holds no request-block; "
                f"minimum is {self.host_block_bytes / 1e9:.6g} GB"
            )

    @property
    def segment_elems(self) -> int:
        """Elements of one K (or V) layer-block: block_size * kv_heads * head_dim."""
        return self.block_size * self.kv_heads * self.head_dim

    @property
    def element_bytes(self) -> int:
        """Bytes per element of ``dtype``."""
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer, K and V together (the model's ``block_bytes``)."""
        return 2 * self.segment_elems * self.element_bytes

    @property
    def host_block_bytes(self) -> int:
        """Bytes of one host request-block: all layers, K and V (block-first layout)."""
        return self.layers * self.block_bytes

    @property
    def host_blocks(self) -> int:
        """Host pool capacity in request-blocks: floor(host_pool_gb * 1e9 / host_block_bytes)."""
        return int(self.host_pool_gb * 1e9 // self.host_block_bytes)

    @property
    def is_cuda(self) -> bool:
        """True when the device pool lives on a GPU."""
        return self.device.startswith("cuda")
