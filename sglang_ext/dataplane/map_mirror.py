"""MapMirror: the store's ``[L, P]`` map as a step's tables read it, kept current by what changed.

A paged step's attention reads ``tab[l, j]``: the device page of layer ``l`` of the batch's
``j``-th page. Built on the host from the map, that is ``L x`` the batch's pages of NumPy work
and upload every step (330K entries at Llama-3-8B shapes, batch 32, 2K-8K contexts: the host
cost of a whole GPU step). The mirror moves that gather to the pool's device:

- ``dev``: a copy of the map on the pool's device (a separate CPU tensor on the CPU, so tests
  catch a move the mirror missed). Every writer of the map reports the pages it touched
  (:meth:`changed`, O(1)); :meth:`sync`, at the step boundary, uploads those pages' columns in
  ONE non-blocking copy from pinned memory (a :class:`PinnedUploadRing`) and scatters them (one ``index_copy_``): work
  proportional to what moved, never to the pool. A sync whose device side raises logs its pages
  again (the map is the truth, the device copy catches up at the next sync), as does the opening
  advance that uploads the columns with its tables (``PagedStepTables.advanced_opening``).
- ``host_bits [P, ceil(L/8)]`` uint8 (host): bit ``l`` of page ``p`` is set when ``(l, p)``
  has no device copy. A request's offloaded layers are the OR of its pages' rows
  (``np.bitwise_or.reduceat``: ``L / 8`` bytes per page instead of ``L`` map reads), and the
  batch's host layer-pages a popcount. Refreshed for the changed pages at :meth:`sync`.

On CUDA the scatter is ordered on the current (compute) stream before the gathers that read it.
"""

from __future__ import annotations

import numpy as np
import torch

from sglang_ext.dataplane.pinned_upload_ring import PinnedUploadRing
from sglang_ext.dataplane.sorted_ids import distinct_sorted

SMALL_ISIN = 8192
"""Up to this many (logged column, page) pairs :meth:`MapMirror.pending_within` compares them
all at once: ``np.isin`` sorts, ~50 us for a decode step's handful of pages on the 2-core host."""
SMALL_SET = 256
"""Up to this many logged column entries :meth:`MapMirror.pending_within` compares Python sets."""
POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.int64)
"""Set bits of each byte value."""


class MapMirror:
    """Device copy of the map plus per-page host-layer bits (module docstring)."""

    def __init__(self, map_np: np.ndarray, device: torch.device) -> None:
        self.map_np = map_np
        self.layers = int(map_np.shape[0])
        self.device = device
        self.dev = torch.from_numpy(map_np.copy()).to(device)
        """``[L, P]`` int32 on the pool's device: ``map_np`` as of the last :meth:`sync`."""
        self.rows = self.dev.unbind(0)
        """``dev``'s rows (views, made once: a fetch takes its layer's without an op)."""
        self.host_bits = np.ascontiguousarray(self._bits(map_np))
        """``[P, ceil(L / 8)]`` uint8: bit ``l`` (little-endian) set where ``(l, p)`` is host-only."""
        self._log: list[np.ndarray] = []
        self.changes = 0
        """Calls of :meth:`changed` that logged pages (columns read at one count are current while it holds)."""
        self._covered: tuple[int, np.ndarray] | None = None
        """``(changes, pages)`` of the last :meth:`pending_within` that answered True with columns
        pending: the log is within ``pages`` while :attr:`changes` is that count."""
        self.synced_columns = 0
        """Page columns uploaded since construction (a test reads it: proportional to moves)."""
        self.syncs = 0
        """Syncs that moved columns (a table built at one count is current while it holds)."""
        self._ring = PinnedUploadRing(device)
        """Pinned buffers of the column uploads (CUDA)."""
        self.staged = self.device.type != "cpu"
        """The columns go up through :attr:`_ring` (a device pool); on the CPU they are scattered
        directly (a test may set it to run the device path on the CPU)."""

    @staticmethod
    def _bits(cols: np.ndarray) -> np.ndarray:
        """``host_bits`` rows of the map columns ``cols`` (``[k, ceil(L/8)]``, a transposed view:
        assigned into :attr:`host_bits`, or made contiguous once at construction)."""
        return np.packbits(cols < 0, axis=0, bitorder="little").T

    def changed(self, pages: np.ndarray) -> None:
        """The map's columns of ``pages`` (int64, repeats allowed) were written."""
        if pages.size:
            self._log.append(np.array(pages, dtype=np.int64, copy=True))
            self.changes += 1

    @property
    def pending(self) -> bool:
        """Columns changed since the last :meth:`sync`."""
        return bool(self._log)

    def pending_within(self, pages: np.ndarray) -> bool:
        """Every column changed since the last :meth:`sync` is one of ``pages``."""
        if not self.pending:
            return True
        log = np.concatenate(self._log) if len(self._log) > 1 else self._log[0]
        if log.size <= SMALL_SET:  # a decode step's placed pairs: two small sets (~4 us; the 2-D compare ~11)
            within = set(log.tolist()) <= set(pages.tolist())
        elif log.size * pages.size <= SMALL_ISIN:  # no sort
            within = bool((log[:, None] == pages[None, :]).any(axis=1).all())
        else:
            within = bool(np.isin(log, pages).all())
        if within:
            self._covered = (self.changes, pages)
        return within

    def sync(self, known: tuple[np.ndarray, np.ndarray, int] | None = None) -> None:
        """Bring ``dev`` and ``host_bits`` up to date with the map (see module docstring).
        ``known``: ``(pages, cols, seen)``, distinct pages, their ``[L, k]`` map columns read when
        :attr:`changes` was ``seen``. They are the sync's -- no distinct pass over the log, no
        read of the map -- when :meth:`pending_within` answered True for this very ``pages``
        array and nothing changed since it nor since the columns were read; else ignored."""
        if not self._log:
            return
        taken = self._known(known)
        if taken is not None:
            pages, cols = taken
        else:
            pages = distinct_sorted(np.concatenate(self._log)) if len(self._log) > 1 else distinct_sorted(self._log[0])
            cols = None
        try:
            if cols is None:
                cols = self._take(pages)
            else:
                self._took(pages, cols)
            k = int(pages.size)
            if not self.staged:
                self.dev.index_copy_(1, torch.from_numpy(pages), torch.from_numpy(np.ascontiguousarray(cols)))
                return
            packed = np.empty(k + -(-self.layers * k // 2), dtype=np.int64)
            packed[:k] = pages
            packed[k:].view(np.int32)[: self.layers * k] = cols.reshape(-1)
            both, _ = self._ring.upload(packed)
            values = both[k:].view(torch.int32)[: self.layers * k].view(self.layers, k)
            self.dev.index_copy_(1, both[:k], values)
        except BaseException:
            self.changed(pages)  # not on the device: still due (the next sync uploads them)
            raise

    def sync_within(self, pages: np.ndarray,
                    known: tuple[np.ndarray, np.ndarray, int] | None = None) -> np.ndarray | None:
        """:meth:`sync`'s host side when every pending column is one of ``pages`` (distinct; the
        caller checked :meth:`pending_within`) and the caller uploads the columns with its own
        (ONE upload for a step's tables and the mirror): returns the ``[L, k]`` int32 columns
        of ``pages`` to upload and :meth:`scatter`, or None when nothing was pending (``dev``
        already holds them). ``known``: as :meth:`sync`'s, for these ``pages``."""
        if not self._log:
            return None
        taken = self._known(known) if known is not None and known[0] is pages else None
        if taken is None:
            cols = self._take(pages)
        else:
            cols = taken[1]
            self._took(pages, cols)
        return np.ascontiguousarray(cols, dtype=np.int32)

    def _known(self, known: tuple[np.ndarray, np.ndarray, int] | None) -> tuple[np.ndarray, np.ndarray] | None:
        """``(pages, cols)`` of ``known`` (``(pages, cols, seen)``) when they are the pending
        sync's: :meth:`pending_within` answered True for this very ``pages`` array and nothing was
        logged since that answer nor since the columns were read (``seen``); else None."""
        covered = self._covered
        if (known is None or known[2] != self.changes or covered is None or covered[0] != self.changes
                or covered[1] is not known[0]):
            return None
        return known[0], known[1]

    def _take(self, pages: np.ndarray) -> np.ndarray:
        """The host side of a sync of ``pages`` (the log emptied, the bits and counts updated):
        their columns of the map, ``[L, k]``."""
        cols = np.take(self.map_np, pages, axis=1)
        self._took(pages, cols)
        return cols

    def _took(self, pages: np.ndarray, cols: np.ndarray) -> None:
        """The bits and counts updated for the columns ``cols`` of ``pages``, then the log emptied
        (a raise before leaves the log: the next sync does it again)."""
        self.host_bits[pages] = self._bits(cols)
        self._log = []
        self._covered = None
        self.syncs += 1
        self.synced_columns += int(pages.size)

    def scatter(self, pages: torch.Tensor, cols: torch.Tensor) -> None:
        """The device side of :meth:`sync_within`: ``dev[:, pages] = cols`` (uploaded by the caller;
        a caller that fails between the two reports the pages :meth:`changed` again)."""
        self.dev.index_copy_(1, pages, cols)

    def host_layers(self, pages: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """``[L, b]`` bool: whether request ``r`` (pages ``pages[starts[r]:starts[r+1]]``, each
        range non-empty) has any host-only page at layer ``l``. Call after :meth:`sync`."""
        if not starts.size:
            return np.zeros((self.layers, 0), dtype=bool)
        any_host = np.bitwise_or.reduceat(self.host_bits[pages], starts, axis=0)
        return np.unpackbits(any_host, axis=1, count=self.layers, bitorder="little").T.astype(bool)

    def host_count(self, pages: np.ndarray) -> int:
        """Host-only layer-pages among every layer of ``pages`` (repeats counted)."""
        return int(POPCOUNT[self.host_bits[pages]].sum())
