"""DeviceCapacity: a slot space wider than the device, and the device pages it leaves the layered pool.

SGLang sizes its KV slot space from a memory profile: the device memory left after the weights
(under ``--mem-fraction-static``), divided by the bytes of one token at *every* layer, capped by
``--max-total-tokens`` ("larger than the profiled value: use the profiled value instead"). Its
pool holds every layer of every slot on the device, so that cap is right for it. The layered pool
holds every layer of every slot in *host* memory and only ``--kv-gpu-budget-tokens`` layer-tokens
on the device -- so on a GPU the profile's cap would keep the slot space (the tokens SGLang admits
and keeps) to what fits the device at every layer, and offloading could never serve more KV than
stock SGLang: the one thing it is for (OrbitFlow §1; LayerKV §1: the waiting queue grows because
the KV cache is full, not because the GPU computes too slowly).

So under ``--enable-layered-kv`` a ``--max-total-tokens`` above the profile is honoured
(:mod:`sglang_ext.capacity_hooks`): the slot space is what was asked for (its host pool checked
against host memory, as always: :func:`~sglang_ext.dataplane.host_pool.host_pool_limit` and, at
launch, :class:`~sglang_ext.host_pool_floor.HostPoolFloor`), and the device keeps what the profile
measured. This class is that record and the arithmetic of the device pages (pure; no SGLang):

* without ``--kv-gpu-budget-tokens`` the device holds the profile's tokens at every layer, less
  kvplane's device buffers that grow with the slot space: the paged layout's copy of the ``[L, P]``
  int32 page map (:class:`~sglang_ext.dataplane.map_mirror.MapMirror`) and, with
  ``--kv-cuda-graphs on``, the graphs' table of the same size
  (:class:`~sglang_ext.dataplane.graph_step_buffers.GraphStepBuffers`). It must hold one layer of
  the whole slot space, as the staging room assumes (:mod:`~sglang_ext.dataplane.staging_room`: a
  batch over every slot is then always staged; below it a full batch would be read at rest,
  synchronously, every step), else the start is refused naming the largest slot space it holds;
* with it, a budget the profile cannot hold is refused at start (naming both flags), where a
  bigger device pool would otherwise be allocated into the memory SGLang keeps for activations and
  CUDA graphs and fail, or crowd them out, mid-serving. (A budget below one layer of the slot
  space is the user's choice, as without a wider slot space.)

What else grows with the slot space is SGLang's, and kept to the profile's size where it is on the
device and sized from it: the request count and so the ``[requests, context]`` int32 request
table (:meth:`~sglang_ext.capacity_hooks.CapacityHooks.around_resolve_max_num_reqs`). The token
allocator's free list and the eager runner's per-token registry (tens of bytes a token) come out
of SGLang's slack (``1 - --mem-fraction-static``).

Without ``--max-total-tokens``, or with one the profile fits, nothing changes: SGLang's slot space
and, by default, every layer of it on the device (the identity layout, which pins no host pool:
``SlotStoreConfig.host_tier``).
"""

from __future__ import annotations

from dataclasses import dataclass

MAP_ENTRY_BYTES = 4
"""Bytes of one ``[L, P]`` page-map entry in its device mirror (int32)."""


def budget_pages(budget_tokens: int, page_size: int) -> int:
    """Device layer-pages of ``--kv-gpu-budget-tokens``: its whole pages; ValueError below one."""
    pages = budget_tokens // page_size
    if pages < 1:
        raise ValueError(f"--kv-gpu-budget-tokens={budget_tokens} is below one page ({page_size} tokens)")
    return pages


@dataclass(frozen=True)
class DeviceCapacity:
    """SGLang's profiled slot space and the wider one the layered pool was built for (tokens)."""

    profiled_tokens: int
    """Tokens SGLang's memory profile fits on the device at every layer (page-aligned, PP-synced:
    SGLang's own figure)."""
    slot_tokens: int
    """The slot space the pool holds: ``--max-total-tokens``, page-aligned (> ``profiled_tokens``)."""

    def __post_init__(self) -> None:
        for name in ("profiled_tokens", "slot_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DeviceCapacity.{name}={value!r} must be an int >= 1")
        if self.slot_tokens <= self.profiled_tokens:
            raise ValueError(f"DeviceCapacity: slot_tokens={self.slot_tokens} must exceed "
                             f"profiled_tokens={self.profiled_tokens} (a slot space the device fits needs none)")

    def profiled_pages(self, *, layers: int, page_size: int) -> int:
        """Layer-pages the profile's device memory holds: its whole pages at every layer."""
        return self.profiled_tokens // page_size * layers

    @staticmethod
    def map_pages(*, layers: int, logical_pages: int, layer_page_bytes: int) -> int:
        """Layer-pages' worth of device memory the paged layout's page-map mirror takes."""
        return -(-(layers * logical_pages * MAP_ENTRY_BYTES) // layer_page_bytes)

    def largest_slot_tokens(self, *, layers: int, page_size: int, layer_page_bytes: int, maps: int = 1) -> int:
        """The largest page-aligned slot space whose one layer (``tokens // page + 1`` pages, the
        padding page included) fits on the device beside its ``maps`` page-map copies: what
        :meth:`device_pages` accepts without a budget (0: not even one page)."""
        fits = self.profiled_pages(layers=layers, page_size=page_size)

        def fit(n: int) -> bool:
            return fits - maps * self.map_pages(layers=layers, logical_pages=n, layer_page_bytes=layer_page_bytes) >= n

        lo, hi = 1, max(1, fits)  # n pages: fit(lo) or none fits; the answer is the largest n that fits
        if not fit(lo):
            return 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fit(mid) else (lo, mid - 1)
        return (lo - 1) * page_size

    def device_pages(self, *, layers: int, page_size: int, logical_pages: int, layer_page_bytes: int,
                     budget_tokens: int | None, maps: int = 1) -> int:
        """Device layer-pages of the layered pool over this slot space (module docstring), beside
        ``maps`` device copies of the page map (2 with ``--kv-cuda-graphs on``); ValueError, with
        the figures and the flags to change, when the profile cannot hold
        ``--kv-gpu-budget-tokens`` (``budget_tokens``) or, without it, one layer of the slot space."""
        fits = self.profiled_pages(layers=layers, page_size=page_size)
        mirror = maps * self.map_pages(layers=layers, logical_pages=logical_pages, layer_page_bytes=layer_page_bytes)
        what = (f"SGLang's memory profile fits {self.profiled_tokens} tokens at all {layers} layers on the "
                f"device ({fits} pages of {page_size} token(s) a layer), and the page map of the "
                f"--max-total-tokens {self.slot_tokens} slot space takes {mirror} of them")
        if budget_tokens is None:
            if fits - mirror < logical_pages:
                most = self.largest_slot_tokens(layers=layers, page_size=page_size,
                                                layer_page_bytes=layer_page_bytes, maps=maps)
                raise ValueError(
                    f"kvplane layered KV: {what}, leaving {fits - mirror} device pages for the {logical_pages} "
                    f"pages of one layer of the slot space that every batch's staging may need; lower "
                    f"--max-total-tokens to at most {most}, raise --mem-fraction-static, or set "
                    "--kv-gpu-budget-tokens to accept batches read from host memory at rest")
            return fits - mirror
        pages = budget_pages(budget_tokens, page_size)
        if pages + mirror > fits:
            raise ValueError(
                f"--kv-gpu-budget-tokens={budget_tokens} ({pages} pages) does not fit the device: {what}; "
                f"lower it to at most {max(0, fits - mirror) * page_size} or raise --mem-fraction-static")
        return pages
