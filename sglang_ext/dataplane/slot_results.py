"""Inputs and results of the slot-keyed layered pool (:mod:`sglang_ext.dataplane.slot_residency`).

Pure data (standard library only). A *page* is one page of SGLang's KV slot space
(``slot // page_size``); a *layer-page* is one layer of one page (K and V of ``page_size``
tokens), the unit the device pool hands out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

_INT = frozenset({int})
"""Page ids are plain ints (``bool`` and NumPy scalars are not ``int`` by type)."""


@dataclass(frozen=True)
class RequestResidency:
    """What the plan wants for one request at the next step."""

    pages: tuple[int, ...]
    """The request's logical pages, in order (from ``req_to_token``)."""
    gpu_layers: tuple[bool, ...]
    """Wanted device residency per layer (True = on device); one entry per layer."""
    paused: bool = False
    """Paused: its resident layers become removable (dropped lazily, highest layer first)."""
    planned: bool = True
    """False: no plan covers this request yet -- ``gpu_layers`` is ignored and the pool's local
    fallback decides (new pages on device while they fit, else the highest layers of the largest
    unplanned requests go to host)."""
    uncached_pages: int = 0
    """eLLM's uncached prefix (``docs/recompute.md``): the first ``uncached_pages`` pages are wanted
    on the device in no layer (recomputed or fetched each step). At most ``len(pages) - 1``: the
    page of the token being decoded stays cached."""

    def __post_init__(self) -> None:
        pages = self.pages  # C-level checks (a turnover installs thousands of pages)
        if pages and (not set(map(type, pages)) <= _INT or min(pages) < 0):
            raise ValueError(f"RequestResidency.pages must be non-negative ints, got {self.pages!r}")
        if not self.gpu_layers or any(not isinstance(x, bool) for x in self.gpu_layers):
            raise ValueError(
                f"RequestResidency.gpu_layers must be a non-empty tuple of bools, got {self.gpu_layers!r}"
            )
        u = self.uncached_pages
        if not isinstance(u, int) or isinstance(u, bool) or u < 0 or (u and u > len(self.pages) - 1):
            raise ValueError(
                f"RequestResidency.uncached_pages must be an int in [0, len(pages) - 1 = "
                f"{max(len(self.pages) - 1, 0)}], got {u!r}"
            )

    def on_device(self) -> RequestResidency:
        """This want with every layer of every page on the device, not paused, no uncached prefix:
        what a store without a host tier keeps (:attr:`SlotStoreConfig.host_tier`: a paused
        request's KV stays in place as a running one's, its new pages placed); itself when it is that."""
        if self.uncached_pages == 0 and not self.paused and all(self.gpu_layers):
            return self
        return replace(self, gpu_layers=(True,) * len(self.gpu_layers), paused=False, uncached_pages=0)


@dataclass(frozen=True)
class ResidencyDelta:
    """What one reconciliation at a step boundary did."""

    loaded_layer_pages: int
    """Layer-pages copied host -> device (onloads of pages that held KV)."""
    offloaded_layer_pages: int
    """Layer-pages whose device copy was dropped (host copy made current first)."""
    removable_dropped_layer_pages: int
    """Of ``offloaded_layer_pages``: layers of paused requests given up for space."""
    placed_new_layer_pages: int
    """Fresh layer-pages (no KV yet) given a device page."""
    shortfall_layer_pages: int
    """Layer-pages wanted on device that did not fit; they stay on host (nothing lost)."""
    local_offloaded_layers: int
    """(request, layer) pairs the local fallback heuristic switched to host."""
    h2d_bytes: int
    """Bytes copied host -> device."""
    d2h_bytes: int
    """Bytes copied device -> host (dirty write-back)."""


@dataclass(frozen=True)
class ResidencyStats:
    """Snapshot of the pool's residency."""

    device_pages_used: int
    """Device layer-pages holding KV."""
    device_pages_total: int
    """Device layer-pages available (the GPU KV budget in pages)."""
    staging_pages: int
    """Device pages used as staging for offloaded layers (0 on the gather path)."""
    host_pages: int
    """Logical pages in the host pool (every page has a host home for all layers; 0 without a
    host tier, :attr:`SlotStoreConfig.host_tier`)."""
    live_requests: int
    """Requests the pool tracks (running or paused)."""
    live_layer_pages: int
    """Layer-pages of live requests' pages (layers x distinct pages)."""
    host_layer_pages: int
    """Of ``live_layer_pages``: those whose only copy is on host."""
    host_fraction: float
    """``host_layer_pages / live_layer_pages`` (0.0 when nothing is live)."""
    h2d_bytes_total: int
    """Bytes copied host -> device since start."""
    d2h_bytes_total: int
    """Bytes copied device -> host since start."""
    host_write_bytes_total: int
    """Bytes of new KV that reached host memory (write-back of staged offloaded layers) since start."""
    shortfall_layer_pages_total: int
    """Layer-pages that were wanted on device but did not fit, summed over steps."""
    staged_steps_total: int = 0
    """Forwards run through the staged pipeline (tables built once, per-layer fetch events)."""
    overflow_steps_total: int = 0
    """Forwards whose batch could not be staged inside the budget (served at rest, with syncs)."""
    fetched_layer_pages_total: int = 0
    """Layer-pages fetched host -> staging by the layer pipeline."""
    h2d_seconds_total: float = 0.0
    """Seconds of host -> device copies since start (CPU: wall time of the synchronous copies;
    CUDA: event pairs on the transfer stream, booked when harvested at a later step boundary)."""
    d2h_seconds_total: float = 0.0
    """Seconds of device -> host copies since start (measured like ``h2d_seconds_total``)."""
    stall_seconds_total: float = 0.0
    """Seconds steps waited on transfers since start (CPU: the copies' wall time; CUDA: the
    compute stream's waits on transfer events, timed by event pairs)."""
    journalled_decode_steps_total: int = 0
    """Steady decode steps whose bookkeeping was journalled (:class:`DecodeJournal`)."""
    ended_batches_total: int = 0
    """Batches of recorded releases and frees applied (:class:`EndedRequests`)."""
    advanced_decode_steps_total: int = 0
    """Paged steady decode steps run on the last step's tables advanced by one token (no build,
    no upload: :meth:`PagedDecodeStep.advance`)."""
    opened_advances_total: int = 0
    """Paged steady decode steps that opened pages and still ran on the last step's tables,
    advanced with those pages spliced in (one upload: ``PagedStepTables.advanced_opening``)."""
    resident_builds_total: int = 0
    """Paged steady decode steps built knowing their batch resident (the host-bit pass skipped:
    :meth:`PagedDecodeStep.still_resident`)."""
    opened_one_pass_total: int = 0
    """Paged decode steps whose opened pages were observed and placed in one pass
    (:class:`~sglang_ext.dataplane.opened_pages.OpenedPages`; the others' went through
    ``observe`` and ``reconcile``)."""
    staged_advances_total: int = 0
    """Paged steady decode steps that stage host-only layers (a placed batch) and still ran on
    the last step's tables, advanced with the same staging pages (``PagedStepTables.advanced_staged``)."""
    decode_turnovers_total: int = 0
    """Decode steps whose batch changed since the last step (a request finished or joined) that
    continued what each request held instead of reading every request's slots (:class:`DecodeContinuity`)."""
    slot_handoffs_total: int = 0
    """Steady decode boundaries that took their new slots from the allocation hook's host list
    (:class:`~sglang_ext.dataplane.host_slots.HostSlots`: no second read of the device)."""
    slot_readbacks_total: int = 0
    """Steady decode boundaries that read their new slots back from the tensor (on a GPU a sync
    of the forward stream: nothing was published for that tensor)."""

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}
