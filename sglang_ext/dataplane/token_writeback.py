"""TokenWriteback: a placed decode step's new tokens of host-only layer-pages, written back to
host memory in ONE launch per step, token rows instead of pages.

Before, a paged decode step wrote back, after each offloaded layer, the staged page that had
received the request's new token (SuperInfer §4.3's write-back of the decode token): one D2H
launch per offloaded layer (16 of the 32 copy launches of the H200's half-offloaded step in
``kvplane gpu-check`` run 14, each with its events and Triton launch on the host), whole pages
(``page_size`` times the bytes of the token), and every fetch its slot released had to wait for
that write-back (the fetch overwrites the staging page the write-back reads).

Now each new token of a host-only (layer, request) is also *parked*: :meth:`park` copies the
layer's new K and V rows (``[m, H, D]``, the batch's tokens in order) into a step buffer
``[S, 2, m, H, D]`` (``S``: the layers with such tokens) -- two device copies (one launch with
the store's ``row_writer``), no host work, inside the layer. After the last such layer,
:meth:`LayerPipeline.end_layer` issues ONE D2H of the parked rows to the tokens' rows of the
block-first host pool (``host_rows``: the pool as
``[P * L * 2 * page_size, H * D]``; row ``((p * L + l) * 2 + kv) * page_size + offset``), from the
step's single upload of indices. The host copy then equals what the page write-back left (the
staged page is the host page plus the token), the staging page is free to be overwritten at
once, so fetches wait on nothing but the compute stream, and the next step's fetches and moves
are fenced after the write-back as before (``TransferEngine.wait_fence``).

Only steps with one new token per request park (decode); a step that writes several tokens per
request (prefill, extend, speculative) keeps the per-layer page write-back: its buffer would be
as large as the chunk. The buffer is transient device memory outside the KV budget (at
Llama-3-8B shapes, batch 32, half the layers offloaded: 2 MiB a step), allocated at the
boundary and kept alive for the copy (``record_stream``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from sglang_ext.dataplane.step_tables import Launch

if TYPE_CHECKING:
    from sglang_ext.dataplane.slot_kv_store import RowWriter


@dataclass
class TokenWriteback:
    """The step's parked token rows and their one D2H launch (module docstring)."""

    slots: tuple[int, ...]
    """Per layer: its slot in :attr:`buf` (``-1``: no host-only new token at that layer)."""
    launch: Launch
    """The D2H: ``segments`` token rows (K rows then V rows) from ``offset`` of the step's int64
    upload (sources: rows of ``buf`` viewed 2-D; destinations: rows of the host pool's
    ``host_rows``); ``layer`` and ``trigger``: the last layer with parked tokens."""
    pairs: int
    """(layer, request) pairs written back (the page write-back's layer-pages)."""
    tokens: int
    """The step's new tokens (``m``: rows per slot of :attr:`buf`)."""
    new_buf: Callable[[int, int], torch.Tensor] = field(compare=False, repr=False)
    """Allocates :attr:`buf` (``new_buf(S, m)``): at :meth:`allocate`."""
    buf: torch.Tensor | None = field(default=None, compare=False, repr=False)
    """``[S, 2, m, H, D]`` on the pool's device; None until :meth:`allocate` (a step a CUDA graph
    replays parks into the graph's own buffer and never allocates it)."""
    _rows: tuple[torch.Tensor, ...] = field(init=False, compare=False, repr=False, default=())
    """``buf`` unbound into its ``2 S`` ``[m, H, D]`` parts (K then V of each slot), at the boundary:
    a layer's park is then its two copies and nothing else."""

    writer: RowWriter | None = field(default=None, compare=False, repr=False)
    """The store's :attr:`~SlotKVStore.row_writer` (set at the boundary): a park is then one launch
    to rows :attr:`rows_index`; None: two copies."""
    rows_index: torch.Tensor | None = field(default=None, compare=False, repr=False)
    """Rows ``0..m-1`` on the buffer's device (the store's :meth:`~SlotKVStore.row_ids`), set with
    :attr:`writer`."""
    places: tuple[np.ndarray, ...] | None = field(default=None, compare=False, repr=False)
    """``(u_host, src_k, w_layer, w_j)`` of :meth:`plan`: a next step whose host-only new tokens sit at the same
    (layer, token) places reuses the slots and sources (:meth:`plan`'s ``like``)."""
    memo: dict[Any, np.ndarray] = field(default_factory=dict, compare=False, repr=False)
    """Arrays derived from the slots and sources alone (a graph's park rows), shared with the
    writebacks planned ``like`` this one."""

    @property
    def layers(self) -> int:
        """Layers with parked tokens (``S``: slots of :attr:`buf`; the others' slot is -1)."""
        return len(self.slots) - self.slots.count(-1)

    def allocate(self) -> None:
        """The buffer and its parts (the device half of the step's tables: at the boundary of a
        step that runs eagerly)."""
        if self.buf is None:
            s = self.layers
            self.buf = buf = self.new_buf(s, self.tokens)
            _, _, m, h, d = buf.shape
            self._rows = buf.view(2 * s, m, h, d).unbind(0)

    def park(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep layer ``layer``'s new K and V (``[m, H, D]``) for the write-back: two copies, or
        one launch of :attr:`writer` to rows ``0..m-1``."""
        slot = self.slots[layer]
        if slot < 0:
            return
        self.allocate()  # a no-op: allocated at the boundary (a net for tables made without it)
        if self.writer is None:
            self._rows[2 * slot].copy_(k)
            self._rows[2 * slot + 1].copy_(v)
            return
        self.writer(self._rows[2 * slot], self._rows[2 * slot + 1], self.rows_index, k, v)

    def src_rows(self) -> torch.Tensor:
        """:attr:`buf` as the launch's source rows ``[S * 2 * m, H * D]``."""
        self.allocate()
        assert self.buf is not None
        return self.buf.view(-1, self.buf.shape[-2] * self.buf.shape[-1])

    def through(self, layer: int, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The launch's indices (``src``, ``dst``: K then V halves) cut to the pairs of layers up
        to ``layer``: slots number the parked layers in order, so those are the rows of the
        first slots."""
        n, m = self.pairs, self.tokens
        first = sum(1 for slot in self.slots[: layer + 1] if slot >= 0)
        keep = src[:n] // (2 * m) < first
        return np.concatenate([src[:n][keep], src[n:][keep]]), np.concatenate([dst[:n][keep], dst[n:][keep]])

    @classmethod
    def plan(cls, u_host: np.ndarray, pages: np.ndarray, offsets: np.ndarray, page_size: int, offset: int,
             new_buf: Callable[[int, int], torch.Tensor],
             like: TokenWriteback | None = None) -> tuple[TokenWriteback, np.ndarray] | None:
        """The write-back of new tokens ``j`` (``pages[j]`` at ``offsets[j]``) host-only at layers
        ``u_host[l, j]`` (``[L, m]``), its indices placed at ``offset`` of the step's int64 upload:
        ``(it, indices)`` with the indices src K, src V, dst K, dst V (layer-major, then token
        order); None when there are none. ``new_buf(S, m)`` allocates the buffer (:meth:`allocate`).
        ``like``: the last step's (a steady step's host-only places seldom move): where its
        ``u_host`` equals this one, its slots, sources and :attr:`memo` are reused; only the
        destinations are computed."""
        layers, m = u_host.shape
        if like is not None and like.places is not None and like.places[0].shape == u_host.shape \
                and like.launch.offset == offset and (like.places[0] == u_host).all():
            _, src_k, w_layer, w_j = like.places
            n = like.pairs
            it = cls(slots=like.slots, launch=like.launch, pairs=n, tokens=int(m), new_buf=new_buf,
                     places=like.places, memo=like.memo)
        else:
            w_layer, w_j = np.nonzero(u_host)
            n = int(w_layer.size)
            if not n:
                return None
            used = np.flatnonzero(u_host.any(axis=1))
            slot_of = np.full(layers, -1, dtype=np.int64)
            slot_of[used] = np.arange(used.size)
            src_k = slot_of[w_layer] * 2 * m + w_j
            last = int(used[-1])
            it = cls(slots=tuple(slot_of.tolist()), launch=Launch(last, last, offset, 2 * n), pairs=n, tokens=int(m),
                     new_buf=new_buf, places=(u_host.copy(), src_k, w_layer, w_j))
        src = it.memo.get("src")  # the sources depend on the places alone: kept for the steps planned alike
        if src is None:
            src = it.memo["src"] = np.concatenate([src_k, src_k + m])
        out = np.empty(4 * n, dtype=np.int64)
        out[: 2 * n] = src
        dst_k = np.add((pages[w_j] * layers + w_layer) * 2 * page_size, offsets[w_j], out=out[2 * n: 3 * n])
        np.add(dst_k, page_size, out=out[3 * n:])
        return it, out
