"""RecomputeRows: one step's recomputed prefix tokens (eLLM's token-wise partial caching).

eLLM §2.3 / §4.3.1 (``docs/recompute.md``): a request with ``(u, k)`` keeps its first ``u`` pages
in no device layer. Every decode step the prefix's ``u * page_size`` tokens (positions
``0 .. u*ps - 1``) run through the model in the same forward as the decode tokens; at each layer
``l < k`` their K/V are written into *transient* device pages (one layer of the prefix, reused
layer after layer) which the request's decode token reads through the step's table; at layers
``>= k`` the prefix is fetched from host memory like any host-only layer-page, overlapped with
the layers before it. Recomputation is exact: a prefix token at position ``i`` attends only to
positions ``<= i``, all inside the prefix.

Token order: requests by decreasing ``k`` (stable in batch order), each request's tokens in
position order. So the tokens still recomputed at layer ``l`` are a prefix of the list:
``active[l]`` of them -- the rows the forward writes at ``l`` are ``rows[l][:active[l]]``.

Built on the host with the step's tables (:class:`StepTables`), uploaded in the same one copy.
"""

from __future__ import annotations

import numpy as np
import torch


class RecomputeRows:
    """Device rows, segments and positions of the step's recompute tokens (module docstring)."""

    def __init__(self, recompute: np.ndarray, rec: np.ndarray, tab: np.ndarray, starts: np.ndarray,
                 page_size: int, dump_rows: np.ndarray, offset: int,
                 ids: list[np.ndarray | None] | None = None) -> None:
        """``recompute[i] = (u, k)`` per batch request, ``rec [L, n]`` the (layer, batch page)
        pairs written by recomputation, ``tab`` the step's device pages, ``starts`` each request's
        first batch column, ``dump_rows[l]`` a row no one reads (tokens whose page is resident
        at ``l`` in the identity layout are written there), ``offset`` where the int64 parts
        start in the step's upload, ``ids[i]`` request ``i``'s token ids (at least its prefix):
        uploaded with the tables in token order (:attr:`input_ids`)."""
        u, k = recompute[:, 0].astype(np.int64), recompute[:, 1].astype(np.int64)
        live = np.flatnonzero((u > 0) & (k > 0))
        order = live[np.argsort(-k[live], kind="stable")]
        self.order = order
        """Batch rows of the recomputing requests, in token order."""
        self.tokens = u[order] * page_size
        """Recomputed tokens of each request of :attr:`order`."""
        self.layers_of = k[order]
        """``k`` of each request of :attr:`order`."""
        layers = tab.shape[0]
        m = int(self.tokens.sum())
        self.m = m
        seg = np.repeat(np.arange(order.size, dtype=np.int64), self.tokens)
        pos = np.arange(m, dtype=np.int64) - np.repeat(np.cumsum(self.tokens) - self.tokens, self.tokens)
        col = starts[order][seg] + pos // page_size
        rows = np.where(rec[:, col], tab[:, col] * page_size + (pos % page_size)[None, :], dump_rows[:, None])
        ends = np.cumsum(self.tokens)
        self.spans = [(int(e - t), int(e), int(kk)) for t, e, kk in zip(self.tokens, ends, self.layers_of, strict=True)]
        """``(start, end, k)`` of each request's tokens in the list (host ints)."""
        self.active = [int(self.tokens[self.layers_of > layer].sum()) for layer in range(layers)]
        """Tokens still recomputed at each layer (a prefix of the list)."""
        self.int64_parts = [rows.astype(np.int64).reshape(-1), pos]
        self.int64_size = layers * m + m
        self._has_ids = ids is not None
        if ids is not None:
            self.int64_parts.append(np.concatenate(
                [np.asarray(ids[i], dtype=np.int64)[: int(t)] for i, t in zip(order.tolist(), self.tokens.tolist(),
                                                                               strict=True)]
            ) if m else np.zeros(0, dtype=np.int64))
            self.int64_size += m
        self._offset = offset
        self._layers = layers
        self.rows: torch.Tensor | None = None
        """``[L, m]`` device rows (views of the step's upload, after :meth:`bind`)."""
        self.positions: torch.Tensor | None = None
        """``[m]`` positions of the tokens on the device."""
        self.input_ids: torch.Tensor | None = None
        """``[m]`` token ids on the device (when ``ids`` were given)."""

    @staticmethod
    def mask(recompute: np.ndarray, starts: np.ndarray, req_of_col: np.ndarray,
             layers: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(``[n]`` batch page in its request's uncached prefix, ``[L, n]`` ... and ``layer < k``);
        None when no request has an uncached prefix."""
        u, k = recompute[:, 0], recompute[:, 1]
        col_in_req = np.arange(req_of_col.size) - starts[req_of_col]
        pre = col_in_req < u[req_of_col]
        if not pre.any():
            return None
        return pre, pre[None, :] & (np.arange(layers)[:, None] < k[req_of_col][None, :])

    @staticmethod
    def slots(pre: np.ndarray, rec: np.ndarray, fetched: np.ndarray, req_of_col: np.ndarray,
              batch: int) -> tuple[np.ndarray, np.ndarray]:
        """Non-identity layout: (columns given a staging page, columns given a transient page).

        ``docs/recompute.md``: a request stages its cached pages when it fetches any of them in
        some layer (one layer of them, as without recompute) and the prefix pages it fetches at
        layers ``>= k``; it holds one transient page per recomputed prefix page."""
        colhost = fetched.any(axis=0)
        body_need = np.zeros(batch, dtype=bool)
        body_need[req_of_col[~pre & colhost]] = True
        return np.where(pre, colhost, body_need[req_of_col]), rec.any(axis=0)

    def bind(self, i64: torch.Tensor) -> None:
        """Point :attr:`rows` and :attr:`positions` at the step's uploaded int64 buffer."""
        o, m, layers = self._offset, self.m, self._layers
        self.rows = i64[o: o + layers * m].view(layers, m)
        self.positions = i64[o + layers * m: o + layers * m + m]
        if self._has_ids:
            self.input_ids = i64[o + layers * m + m: o + layers * m + 2 * m]
