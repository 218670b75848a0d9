"""SlotStoreConfig: the validated shapes and options of a :class:`~sglang_ext.dataplane.slot_kv_store.SlotKVStore`."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def layer_page_bytes(page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one layer-page: K and V of ``page_size`` tokens."""
    return 2 * page_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class SlotStoreConfig:
    """Shapes of a :class:`SlotKVStore` (validated)."""

    layers: int
    """Layers held (SGLang's ``layer_num`` of this rank)."""
    page_size: int
    """Tokens per page (SGLang's ``page_size``)."""
    kv_heads: int
    """KV heads per layer on this rank."""
    head_dim: int
    """Head dimension (K and V)."""
    logical_pages: int
    """Pages of SGLang's slot space, padding page 0 included."""
    device_pages: int
    """Device layer-pages (the GPU KV budget in pages)."""
    dtype: torch.dtype
    """Storage dtype."""
    device: str
    """Device of the device pool (``cpu`` in tests, ``cuda:N`` on GPUs)."""
    copy_programs: int | None = None
    """Persistent programs of each Triton copy launch on CUDA (``--kv-copy-programs``); None:
    the kernel's default (``kernels.block_copy.DEFAULT_PROGRAMS``, 8). Ignored by the CPU engine."""
    copy_engine: str = "triton"
    """``triton`` or ``dma`` (``--kv-copy-engine``: the copy engines through
    ``kernels.batched_memcpy``, no SM taken). Ignored by the CPU engine. The core's default is
    the kernels (what the benchmarks and `kvplane gpu-check` measure against, and the fallback);
    the served flag defaults to ``dma`` (``LayeredKVArgs.kv_copy_engine``), which falls back
    here when the driver refuses it."""
    timing_interval: int = 1
    """Time the copies and waits of about one step in this many on CUDA (``--kv-timing-interval``; the
    CUDA events' host cost, :class:`~sglang_ext.dataplane.event_clock.EventClock`); 1: every
    step. Ignored by the CPU engine, whose wall clock costs nothing to read."""
    graph_sink: bool = False
    """Keep one device page where no layer-page ever maps (:attr:`SlotKVStore.sink_page`): a
    CUDA-graph replay pads its batch to the captured size, and the padded rows write and read
    there (:class:`~sglang_ext.dataplane.graph_step_buffers.GraphStepBuffers`). The paged layout
    gives its last page (the budget one page smaller); the identity layout has one already:
    logical page 0 of layer 0, SGLang's padding page, which its allocators never hand out."""
    host_tier: bool = True
    """Keep the block-first host pool. False (identity layout only: offloading frees nothing another
    page could use): no host pool, a one-page scratch for the copy engine's probe and warm-up, and
    :meth:`LayeredKVCore.update_residency` keeps every want on the device."""

    def __post_init__(self) -> None:
        for name in ("layers", "page_size", "kv_heads", "head_dim", "logical_pages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SlotStoreConfig.{name}={value!r} must be an int >= 1")
        if not isinstance(self.device_pages, int) or self.device_pages < 1:
            raise ValueError(f"SlotStoreConfig.device_pages={self.device_pages!r} must be an int >= 1")
        cp = self.copy_programs
        if cp is not None and (isinstance(cp, bool) or not isinstance(cp, int) or cp < 1):
            raise ValueError(f"SlotStoreConfig.copy_programs={cp!r} must be None or an int >= 1")
        if self.copy_engine not in ("triton", "dma"):
            raise ValueError(f"SlotStoreConfig.copy_engine={self.copy_engine!r} must be 'triton' or 'dma'")
        ti = self.timing_interval
        if isinstance(ti, bool) or not isinstance(ti, int) or ti < 1:
            raise ValueError(f"SlotStoreConfig.timing_interval={ti!r} must be an int >= 1")
        if not self.host_tier and not self.identity:
            raise ValueError(
                f"SlotStoreConfig.host_tier=False needs the identity layout (device_pages >= layers * logical_pages "
                f"= {self.layers * self.logical_pages}), got device_pages={self.device_pages}: a budget below "
                "every layer-page keeps the rest in the host pool"
            )

    @property
    def layer_page_bytes(self) -> int:
        """Bytes of one layer-page (K and V)."""
        return layer_page_bytes(self.page_size, self.kv_heads, self.head_dim, self.dtype)

    @property
    def host_pages(self) -> int:
        """Pages of the host pool: every page, or the one-page scratch without a host tier."""
        return self.logical_pages if self.host_tier else 1

    @property
    def host_bytes(self) -> int:
        """Bytes of the host pool (every layer of :attr:`host_pages`)."""
        return self.host_pages * self.layers * self.layer_page_bytes

    @property
    def device_bytes(self) -> int:
        """Bytes of the device page pool: ``device_pages`` layer-pages, at most every layer of
        every page (a larger budget is the identity layout, allocated at exactly that)."""
        return min(self.device_pages, self.layers * self.logical_pages) * self.layer_page_bytes

    @property
    def identity(self) -> bool:
        """The budget holds every layer-page: the identity layout."""
        return self.device_pages >= self.layers * self.logical_pages
