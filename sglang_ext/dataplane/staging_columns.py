"""staging_columns: one staging page per distinct page of a step, however many requests share it.

A staged request's columns (its pages in position order) each read a device staging page at the
layers where their page is host-only: the page is fetched into it and read from it, one layer
after another (OrbitFlow §3.3.1's per-request staging slot, ``b_r`` device pages). SGLang's radix
cache shares prefix pages between requests. When each column took its own staging page, a page
held by ``k`` staged requests:

- took ``k`` staging pages, so a batch sharing a long prefix asked more staging than the device
  budget guarantees (one layer of the slot space) and its steps overflowed to the at-rest path;
- was fetched ``k`` times at each of its host-only layers: ``k`` times the link's bytes.

Here a page that several staged columns hold takes ONE staging page. Its first column in batch
order *owns* it and its fetch copies it; the other columns read the same staging page and fetch
nothing. In the step's uploaded staging array an owner's entry is its staging page ``s`` and a
reader's is ``-2 - s``. The fetch kernel and its index-list twin copy only entries ``>= 0``
(:func:`kernels.block_copy.fetch_segments`). The page tables decode the entry back
(:func:`decoded`); ``-1`` (a column that stages nothing) decodes to itself.

Why the owner's fetch is in time and safe:

- A staging page is read only at the layers where its page is host-only, and whoever holds the
  page is staged at each of those layers. So every holder's fetch trigger for layer ``l`` (the
  last layer before ``l`` at which that request had any host-only page) is at or after the
  page's previous host-only layer. The owner's fetch therefore starts only after every read of
  the previous layer's copy.
- A layer waits for all of its layer's fetches (``LayerPipeline.begin_layer``), whichever
  request's launch carried the shared page.

A page that receives new tokens in the step is never shared here (``private``): its staging page
is written by the layers and written back, as a column of its own. SGLang shares only full
prefix pages, so this does not arise when serving.

The residency keeps free what this takes: its staging reserve counts the distinct pages of the
offloading requests (:class:`~sglang_ext.dataplane.want_counts.WantCounts`, O(a changed
request's pages)); an advanced steady step keeps the sharing (:func:`restaged` where its
staging pages were partly taken). Not done yet: the planner's memory model still counts each
request's pages (shared KV included) per request.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from sglang_ext.dataplane.map_mirror import MapMirror
from sglang_ext.dataplane.slot_kv_store import SlotKVStore
from sglang_ext.dataplane.sorted_ids import distinct_sorted, run_firsts


def shared_columns(pages: np.ndarray, private: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """For staged columns holding ``pages`` (batch order): ``(rank, owners)``, or None when no page
    repeats (each column then owns a staging page of its own, as before sharing existed).
    ``rank[i]``: the index of column ``i``'s staging page among the distinct pages, in the order
    of their first columns (a batch without repeats keeps its columns' order: a request's staging
    pages stay consecutive where the allocator's are). ``owners``: each distinct page's first
    column, in that order. ``private``: columns never shared (pages that receive new tokens)."""
    keys = pages
    if private is not None and private.any():
        keys = np.where(private, -1 - np.arange(pages.size, dtype=np.int64), pages)
    order = np.argsort(keys, kind="stable")  # the batch's pages come in ascending runs: timsort merges them
    first = run_firsts(keys[order])
    if first.all():
        return None
    group = np.cumsum(first) - 1
    owners = order[first]  # stable: each distinct page's first column
    by_place = np.argsort(owners, kind="stable")
    group_rank = np.empty(owners.size, dtype=np.int64)
    group_rank[by_place] = np.arange(owners.size)
    rank = np.empty(keys.size, dtype=np.int64)
    rank[order] = group_rank[group]
    return rank, owners[by_place]


def staged_columns(flat: np.ndarray, need_at: np.ndarray,
                   new_cols: np.ndarray) -> tuple[np.ndarray | None, np.ndarray, np.ndarray | None]:
    """The staging of columns ``need_at`` (ascending) of a step's page lists ``flat``, whose new
    tokens sit in columns ``new_cols`` (private: :func:`shared_columns`): ``(rank, owners,
    readers)``. Staging page ``i`` (of ``owners.size``) is owned and fetched by column
    ``owners[i]`` and read by every column of ``need_at`` of rank ``i``; ``readers``: the columns
    that read a page another column fetches. Without a repeat ``(None, need_at, None)``: each
    column its own page, in order."""
    private = np.zeros(flat.size, dtype=bool)
    private[new_cols] = True
    shared = shared_columns(flat[need_at], private[need_at])
    if shared is None:
        return None, need_at, None
    rank, owners = shared
    reads = np.ones(need_at.size, dtype=bool)
    reads[owners] = False
    return rank, need_at[owners], need_at[reads]


def fetch_entries(stage_col: np.ndarray, readers: np.ndarray) -> np.ndarray:
    """The uploaded staging array: ``stage_col`` with the reader columns ``readers`` encoded as
    ``-2 - s`` (module docstring)."""
    out = stage_col.copy()
    out[readers] = -2 - stage_col[readers]
    return out


def restaged(entries: np.ndarray, gone: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``entries`` (the uploaded staging array) with staging page ``gone[i]`` replaced by
    ``new[i]`` in every column that reads it, its owner and its readers alike (readers stay
    encoded): an advanced step whose staging pages were partly taken meanwhile."""
    real = np.where(entries >= -1, entries, -2 - entries)
    order = np.argsort(gone)
    at = np.searchsorted(gone, real, sorter=order).clip(max=gone.size - 1)
    hit = gone[order[at]] == real
    real = np.where(hit, new[order[at]], real)
    return np.where(entries < -1, -2 - real, real)


def decoded(entries: torch.Tensor) -> torch.Tensor:
    """The staging page of each uploaded entry (a reader's ``-2 - s`` back to ``s``; ``-1`` stays)."""
    return torch.where(entries >= 0, entries, -2 - entries)


def sync_mirror(store: SlotKVStore, mirror: MapMirror,
                known: tuple[np.ndarray, np.ndarray, int] | None = None) -> int:
    """Bring the mirror up to date for a step's tables (``known``: :meth:`MapMirror.sync`'s); its
    sync count (tables built at one count are current while it holds). The scatter must not
    overtake an earlier step's fetches reading the mirror: they are fenced first."""
    if mirror.pending:
        store.engine.wait_fence()
    mirror.sync(known)
    return mirror.syncs


def staging_demand(store: SlotKVStore, pages: Sequence[np.ndarray]) -> int:
    """The staging pages a :class:`~sglang_ext.dataplane.paged_step_tables.PagedStepTables` build
    of the batch ``pages`` (each request's pages) would ask now: the distinct pages of the
    requests with a host-only page at some layer (the build's ``staged_req``), from the map
    mirror in O(the batch's pages). The staging room uses it to make room once for what its own
    evictions add (:meth:`StagingRoom.make_room_for`)."""
    mirror = store.mirror
    if mirror is None:
        raise ValueError("staging_demand needs the paged layout (the store has no map mirror)")
    counts = np.fromiter((p.size for p in pages), dtype=np.int64, count=len(pages))
    nonempty = counts > 0
    if not nonempty.any():
        return 0
    sync_mirror(store, mirror)
    flat = np.concatenate([p for p in pages if p.size])
    kept = counts[nonempty]
    staged = np.bitwise_or.reduceat(mirror.host_bits[flat], np.cumsum(kept) - kept, axis=0).any(axis=1)
    if not staged.any():
        return 0
    return int(distinct_sorted(flat[np.repeat(staged, kept)]).size)
