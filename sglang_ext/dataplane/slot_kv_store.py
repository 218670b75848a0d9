"""SlotKVStore: layered KV storage keyed by SGLang's logical slot/page space.

Primitives (pure mechanism; :class:`~sglang_ext.dataplane.slot_residency.SlotResidency`
decides what goes where):

- ``write(layer, slots, k, v)`` -- new KV: to the layer-page's device copy when it has one
  (marked dirty), else straight to its host home (OrbitFlow §3.2).
- ``gather(layer, slots) -> (k, v)`` -- KV of these slots at this layer, from device pages
  where resident and from host otherwise (one batched gather per side and layer).
- ``sync_dirty()`` -- eager write-back of every dirty device layer-page to host at a step
  boundary (SuperInfer §4.3.2 "eager block rotation"), so a later offload only drops the copy.
- ``onload(layers, pages, copy=)`` / ``offload(layers, pages)`` -- move layer-pages (one
  batched copy per direction); ``release_pages(pages)`` -- the allocator freed these pages.

Layout (docs/sglang-integration.md, "layered pool contract"):

- host ``[P, L, 2, page_size, H, D]``: block-first home of every layer of every logical page
  (pinned on CUDA, plain on CPU);
- device ``[2, N, page_size, H, D]``: ONE page pool shared by all layers (a page holds one
  layer's K and V of ``page_size`` tokens; FlashInfer's NHD paged layout), N = the budget;
  when the budget holds all ``L * P`` layer-pages the layout is the *identity* one
  (``(l, p)`` at page ``l * P + p``), so a layer is one slice read in place;
- map ``[L, P]`` int32: device page of each (layer, page), -1 = only on host. A CPU copy
  drives decisions; the device copy (same tensor on CPU) serves the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sglang_ext.dataplane.block_allocator import BlockAllocator, IdentityPages


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

    def __post_init__(self) -> None:
        for name in ("layers", "page_size", "kv_heads", "head_dim", "logical_pages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SlotStoreConfig.{name}={value!r} must be an int >= 1")
        if not isinstance(self.device_pages, int) or self.device_pages < 0:
            raise ValueError(f"SlotStoreConfig.device_pages={self.device_pages!r} must be an int >= 0")

    @property
    def layer_page_bytes(self) -> int:
        """Bytes of one layer-page (K and V)."""
        return 2 * self.page_size * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def host_bytes(self) -> int:
        """Bytes of the host pool."""
        return self.logical_pages * self.layers * self.layer_page_bytes


class SlotKVStore:
    """Device page pool + block-first host pool + the (layer, page) -> device page map."""

    def __init__(self, config: SlotStoreConfig) -> None:
        self.config = config
        c = config
        self.device = torch.device(c.device)
        self.identity = c.device_pages >= c.layers * c.logical_pages
        """The budget holds every layer-page: ``(l, p)`` lives at device page ``l * P + p``, so
        each layer is one contiguous slice readable in place with SGLang's slot ids."""
        device_pages = c.layers * c.logical_pages if self.identity else c.device_pages
        pin = self.device.type == "cuda"
        self.host = torch.zeros(
            (c.logical_pages, c.layers, 2, c.page_size, c.kv_heads, c.head_dim), dtype=c.dtype, pin_memory=pin
        )
        self.dev = torch.zeros((2, max(device_pages, 1), c.page_size, c.kv_heads, c.head_dim), dtype=c.dtype,
                               device=self.device)
        self.map_cpu = torch.full((c.layers, c.logical_pages), -1, dtype=torch.int32)
        self.map_np = self.map_cpu.numpy()
        """NumPy view of ``map_cpu`` (same memory) for the per-step fast paths: small indexing
        ops cost a few µs in torch's dispatcher and well under one in NumPy."""
        self.map_flat_np = self.map_np.reshape(-1)
        """``map_np`` flat (same memory): ``(l, p)`` is element ``l * P + p``."""
        self._layer_base = np.arange(c.layers, dtype=np.int64)[:, None] * c.logical_pages
        self.map_dev = self.map_cpu if self.device.type == "cpu" else self.map_cpu.to(self.device)
        self.dirty = torch.zeros((c.layers, c.logical_pages), dtype=torch.bool, device=self.device)
        self._dirty_np = self.dirty.numpy() if self.device.type == "cpu" else None
        self.allocator: BlockAllocator | IdentityPages = (
            IdentityPages(device_pages, "device KV pages") if self.identity
            else BlockAllocator(device_pages, "device KV pages")
        )
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        self.host_write_bytes = 0
        self.staging_pages = 0
        """Device pages lent to staging this step (set by SlotPageTables; counted in ``used``)."""
        self._map_stale = False
        self._in_place: list[tuple[torch.Tensor, torch.Tensor]] = []
        """Identity layout: per-layer K/V views (built once; ``dev`` is never reallocated)."""
        if self.identity:
            shape = (c.layers, c.logical_pages * c.page_size, c.kv_heads, c.head_dim)
            k_all, v_all = self.dev[0].view(shape), self.dev[1].view(shape)
            self._in_place = [(k_all[layer], v_all[layer]) for layer in range(c.layers)]

    # ----- map bookkeeping ---------------------------------------------------

    def resident_mask(self) -> torch.Tensor:
        """``[L, P]`` bool: which layer-pages have a device copy (CPU tensor)."""
        return self.map_cpu >= 0

    def publish_map(self) -> None:
        """Copy the CPU map to the device after a boundary changed it (no-op on CPU)."""
        if self._map_stale and self.map_dev is not self.map_cpu:
            self.map_dev.copy_(self.map_cpu, non_blocking=True)
        self._map_stale = False

    # ----- data path -----------------------------------------------------------

    def _rows(self, layer: int, slots: torch.Tensor):
        """Flat row ids of ``slots`` at ``layer``: device K rows (-1 if host-only) and host K rows.

        Device pool as rows ``[2 * N * ps, H, D]`` (V rows = K rows + N * ps); host pool as rows
        ``[P * L * 2 * ps, H, D]`` (V rows = K rows + ps). Plain ``index_select`` /
        ``index_copy_`` on these views is one contiguous-row gather/scatter per side.
        """
        ps = self.config.page_size
        slots = slots.to(self.device, torch.int64)
        pages, offs = slots // ps, slots % ps
        dev_page = self.map_dev[layer].index_select(0, pages).to(torch.int64)
        dev_rows = torch.where(dev_page >= 0, dev_page * ps + offs, -1)
        return pages, offs, dev_rows

    def device_rows(self, layer: int, slots: torch.Tensor) -> torch.Tensor | None:
        """Rows of ``slots`` at ``layer`` in :meth:`device_views` when all are resident, else None."""
        _, _, dev_rows = self._rows(layer, slots)
        return dev_rows if bool((dev_rows >= 0).all()) else None

    def layer_in_place(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Identity layout only: K and V of ``layer`` as ``[P * page_size, H, D]`` views indexed
        by SGLang's slot ids (rows of pages not resident at this layer are stale)."""
        if not self.identity:
            raise RuntimeError("layer_in_place needs the identity layout")
        return self._in_place[layer]

    def all_resident(self, pages: torch.Tensor) -> bool:
        """Whether every layer of these pages has a device copy."""
        return bool((self.map_cpu[:, pages] >= 0).all()) if pages.numel() else True

    def device_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The device pool as flat K and V rows ``[N * page_size, H, D]`` (views, no copy)."""
        return self.dev[0].view(-1, *self.dev.shape[3:]), self.dev[1].view(-1, *self.dev.shape[3:])

    def _host_rows(self, layer: int, pages: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ps, layers = self.config.page_size, self.config.layers
        return ((pages.cpu() * layers + layer) * 2) * ps + offs.cpu()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V ``[n, H, D]`` of ``slots`` at ``layer``: device copy if any, else host."""
        pages, offs, dev_rows = self._rows(layer, slots)
        dev_flat = self.dev.view(-1, *self.dev.shape[3:])
        v_shift = self.dev.shape[1] * self.config.page_size
        resident = dev_rows >= 0
        if bool(resident.all()):
            dev_flat.index_copy_(0, dev_rows, k)
            dev_flat.index_copy_(0, dev_rows + v_shift, v)
            self.dirty[layer, pages] = True
            return
        on_dev = resident.nonzero().squeeze(1)
        if on_dev.numel():
            rows = dev_rows[on_dev]
            dev_flat.index_copy_(0, rows, k[on_dev])
            dev_flat.index_copy_(0, rows + v_shift, v[on_dev])
            self.dirty[layer, pages[on_dev]] = True
        on_host = (~resident).nonzero().squeeze(1)
        host_rows = self._host_rows(layer, pages[on_host], offs[on_host])
        host_flat = self.host.view(-1, *self.host.shape[4:])
        kh, vh = k[on_host].to("cpu"), v[on_host].to("cpu")
        host_flat.index_copy_(0, host_rows, kh)
        host_flat.index_copy_(0, host_rows + self.config.page_size, vh)
        self.host_write_bytes += 2 * kh.numel() * kh.element_size()

    def write_in_place(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mark_dirty: bool = True
    ) -> None:
        """:meth:`write` for the identity layout when every slot's page is resident at ``layer``
        (the caller checked): straight into the layer's slice. ``mark_dirty=False`` when the
        caller already marked these pages dirty at every layer (:meth:`mark_dirty`)."""
        k_layer, v_layer = self._in_place[layer]
        if slots.dtype != torch.int64 or slots.device != self.device:
            slots = slots.to(self.device, torch.int64)
        k_layer.index_copy_(0, slots, k)
        v_layer.index_copy_(0, slots, v)
        if mark_dirty:
            ps = self.config.page_size
            self.dirty[layer, slots if ps == 1 else slots // ps] = True

    def mark_dirty(self, pages: torch.Tensor) -> None:
        """Mark ``pages`` dirty at every layer: one op per step for a forward that writes the
        same slots at each layer (instead of one per layer)."""
        self.dirty[:, pages.to(self.device)] = True

    def mark_dirty_np(self, pages: np.ndarray) -> None:
        """:meth:`mark_dirty` for an int64 NumPy array of pages (NumPy on a CPU store)."""
        if self._dirty_np is not None:
            self._dirty_np[:, pages] = True
        else:
            self.dirty[:, torch.from_numpy(pages).to(self.device)] = True

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[n, H, D]`` of ``slots`` at ``layer`` (device pages, then host pages)."""
        pages, offs, dev_rows = self._rows(layer, slots)
        dev_flat = self.dev.view(-1, *self.dev.shape[3:])
        v_shift = self.dev.shape[1] * self.config.page_size
        resident = dev_rows >= 0
        if bool(resident.all()):
            return dev_flat.index_select(0, dev_rows), dev_flat.index_select(0, dev_rows + v_shift)
        k = torch.empty((dev_rows.numel(), *self.dev.shape[3:]), dtype=self.dev.dtype, device=self.device)
        v = torch.empty_like(k)
        on_dev = resident.nonzero().squeeze(1)
        if on_dev.numel():
            rows = dev_rows[on_dev]
            k.index_copy_(0, on_dev, dev_flat.index_select(0, rows))
            v.index_copy_(0, on_dev, dev_flat.index_select(0, rows + v_shift))
        on_host = (~resident).nonzero().squeeze(1)
        host_rows = self._host_rows(layer, pages[on_host], offs[on_host])
        host_flat = self.host.view(-1, *self.host.shape[4:])
        # one batched host gather and H2D per layer (K rows then V rows)
        staged = host_flat.index_select(0, torch.cat([host_rows, host_rows + self.config.page_size]))
        staged = staged.to(self.device, non_blocking=True)
        m = host_rows.numel()
        k.index_copy_(0, on_host, staged[:m])
        v.index_copy_(0, on_host, staged[m:])
        if self.device.type != "cpu":
            self.h2d_bytes += staged.numel() * staged.element_size()
        return k, v

    # ----- movement at step boundaries ------------------------------------------

    def sync_dirty(self) -> int:
        """Write every dirty device layer-page back to host; return the layer-pages written."""
        layers, pages = self.dirty.nonzero(as_tuple=True)
        if layers.numel() == 0:
            return 0
        layers_c, pages_c = layers.cpu(), pages.cpu()
        dev_pages = self.map_cpu[layers_c, pages_c].to(torch.int64)
        data = self.dev[:, dev_pages.to(self.device)].movedim(0, 1)  # [n, 2, ps, H, D]
        self.host[pages_c, layers_c] = data.to("cpu")
        self.dirty[layers, pages] = False
        self.d2h_bytes += data.numel() * data.element_size()
        return int(layers.numel())

    def offload(self, layers: torch.Tensor, pages: torch.Tensor) -> None:
        """Drop the device copies of these resident layer-pages (dirty ones written back first)."""
        if layers.numel() == 0:
            return
        dev_pages = self.map_cpu[layers, pages].to(torch.int64)
        if bool((dev_pages < 0).any()):
            raise ValueError("offload of a layer-page that is not on device")
        dirty = self.dirty[layers.to(self.device), pages.to(self.device)].cpu()
        if bool(dirty.any()):
            idx = dirty.nonzero().squeeze(1)
            data = self.dev[:, dev_pages[idx].to(self.device)].movedim(0, 1)
            self.host[pages[idx], layers[idx]] = data.to("cpu")
            self.d2h_bytes += data.numel() * data.element_size()
            self.dirty[layers[idx].to(self.device), pages[idx].to(self.device)] = False
        self.map_cpu[layers, pages] = -1
        self.allocator.free(dev_pages.tolist())
        self._map_stale = True

    def onload(self, layers: torch.Tensor, pages: torch.Tensor, copy: torch.Tensor) -> None:
        """Give these host-only layer-pages device pages; copy host KV where ``copy`` is True.

        The caller checked the free count; raises ValueError (nothing changed) otherwise.
        """
        n = int(layers.numel())
        if n == 0:
            return
        if n > self.allocator.free_count:
            raise ValueError(f"onload of {n} layer-pages with {self.allocator.free_count} free device pages")
        if isinstance(self.allocator, IdentityPages):
            # (layer, page) pairs are distinct (mask nonzero / unique pairs): ids are distinct
            dev_pages = self.allocator.take(layers.to(torch.int64) * self.config.logical_pages + pages, unique=True)
        else:
            ids = self.allocator.alloc(n)
            assert ids is not None
            dev_pages = torch.tensor(ids, dtype=torch.int64)
        idx = copy.nonzero().squeeze(1)
        if idx.numel():
            data = self.host[pages[idx], layers[idx]]  # [m, 2, ps, H, D]
            self.dev[:, dev_pages[idx].to(self.device)] = data.to(self.device, non_blocking=True).movedim(1, 0)
            self.h2d_bytes += data.numel() * data.element_size()
        self.map_cpu[layers, pages] = dev_pages.to(torch.int32)
        self._map_stale = True

    def identity_ids(self, pages: np.ndarray) -> np.ndarray:
        """Identity layout: the device pages ``l * P + p`` of every layer of ``pages``
        (``[L, n]`` int64; also the flat indices of those entries in ``map_np``)."""
        return self._layer_base + pages[None, :]

    def place_identity(self, pages: np.ndarray, ids: np.ndarray | None = None) -> None:
        """Identity layout: give every layer of these distinct host-only pages (no KV yet) its
        fixed device page ``l * P + p``; nothing is copied. ``pages``: int64 NumPy array;
        ``ids``: their :meth:`identity_ids` when the caller has them."""
        if ids is None:
            ids = self.identity_ids(pages)
        self.allocator.take_distinct(ids.reshape(-1))  # type: ignore[union-attr]
        self.map_flat_np[ids] = ids
        self._map_stale = True

    def release_pages(self, pages: list[int]) -> None:
        """SGLang's allocator got these pages back: free their device copies (KV is dead)."""
        if not pages:
            return
        p = torch.tensor(pages, dtype=torch.int64)
        sub = self.map_cpu[:, p]
        layers, cols = (sub >= 0).nonzero(as_tuple=True)
        if layers.numel():
            dev_pages = sub[layers, cols].tolist()
            self.map_cpu[layers, p[cols]] = -1
            self.allocator.free(dev_pages)
            self._map_stale = True
        self.dirty[:, p.to(self.device)] = False
