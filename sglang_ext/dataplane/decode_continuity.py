"""DecodeContinuity: what each request held at the last step boundary that carried it, so that a
decode step whose batch changed continues from it instead of reading every request's slots.

SGLang's decode batch changes whenever a request finishes (``filter_batch``) or a prefilled one
joins (``merge_batch``): at batch 32 with a few hundred output tokens a request, several steps in
ten; at batch 128 and more, nearly every step. Before this, any change sent the step down the
general boundary: every request's slots read back from the device (one ``[B, max_len]`` copy and
a host sync), every request observed, its pages recomputed. Yet a decode step changes nothing a
request held but its new token: each request of the batch has ``seq_len - 1`` tokens as of the
last boundary that carried it (its prefill, the last chunk of it, or its last decode step,
paused in between or not) and the same pages, plus the page its new token opens. This object
keeps, per named request, that token count, its last page and (where the step's tables need
them) its page list, and says whether a decode batch continues them.

A request's pages change behind a boundary in one way only: SGLang frees pages a running request
held after rewriting its ``req_to_token`` row (a prefill's copy of a prefix the tree already held
replaced by the tree's pages). :class:`~sglang_ext.dataplane.freed_pages.cut_freed_pages` reports
the requests a free cut (:meth:`EndedRequests.take_rewritten`); they are forgotten here, and their
next step reads their slots again. A released request (finished, aborted, retracted) is
forgotten at its release.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from sglang_ext.dataplane.host_slots import HostSlots

if TYPE_CHECKING:
    from sglang_ext.dataplane.slot_residency import SlotResidency


class DecodeContinuity:
    """Per named request: tokens, last page and page list as of its last boundary (module docstring)."""

    def __init__(self, residency: SlotResidency, page_size: int) -> None:
        self._residency = residency
        self._ps = page_size
        self._known: dict[str, tuple[int, int, np.ndarray | None]] = {}
        """rid -> (tokens, last page, pages in position order; None where no step needed them)."""
        self._last: list[str | None] = []
        """The last step's batch."""
        self.turnovers = 0
        """Decode steps continued across a batch change (a request finished or joined)."""
        self.slots = HostSlots()
        """The decode steps' new slots as the allocation's hook read them (the boundary's input)."""

    def __len__(self) -> int:
        return len(self._known)

    def record(self, rids: Sequence[str | None], lens: Sequence[int], page_lists: Sequence[np.ndarray]) -> None:
        """A general step's batch: request ``rids[i]`` has ``lens[i]`` tokens on ``page_lists[i]``."""
        known, self._last = self._known, list(rids)
        for rid, n, pages in zip(rids, lens, page_lists, strict=True):
            if rid is not None:
                known[rid] = (n, int(pages[-1]) if pages.size else -1, pages)

    def forget(self, rid: str) -> None:
        """``rid`` was released (idempotent)."""
        self._known.pop(rid, None)

    def continued(self, rids: Sequence[str], seq_lens: Sequence[int], slots: Sequence[int],
                  lists: bool) -> tuple[list[int], list[np.ndarray] | None] | None:
        """Whether the decode step of ``rids`` (distinct, each with ``seq_lens[i]`` tokens, its new
        token at slot ``slots[i]``) continues what each request held: every request known, with
        ``seq_lens[i] - 1`` tokens, the new slot at its position in the request's last page or
        opening a page. Then ``(opens, page lists)``: the rows whose token opens a page, and (with
        ``lists``) each request's pages with the opened one appended (None without). None
        otherwise. Changes nothing but applying pending releases and frees and forgetting the
        requests a free cut (module docstring)."""
        res = self._residency
        if res.ended.pending:
            res.settle()
        for rid in res.ended.take_rewritten():
            self._known.pop(rid, None)
        known, ps = self._known, self._ps
        opens: list[int] = []
        out: list[np.ndarray] | None = [] if lists else None
        for i, (rid, n, s) in enumerate(zip(rids, seq_lens, slots, strict=True)):
            entry = known.get(rid)
            if entry is None or entry[0] != n - 1:
                return None
            off = (n - 1) % ps
            if s % ps != off:
                return None
            pages = entry[2]
            if off:
                if s // ps != entry[1]:
                    return None
            else:
                opens.append(i)
                if out is not None and pages is not None:  # written into place (np.append: 3x the calls)
                    grown = np.empty(pages.size + 1, dtype=pages.dtype)
                    grown[:-1] = pages
                    grown[-1] = s // ps
                    pages = grown
            if out is not None:
                if pages is None:
                    return None
                out.append(pages)
        if len(set(rids)) != len(rids):
            return None
        return opens, out

    def advanced(self, rids: Sequence[str], seq_lens: Sequence[int], slots: Sequence[int],
                 page_lists: Sequence[np.ndarray] | None) -> bool:
        """The step :meth:`continued` accepted runs: its requests hold one token more, ``page_lists``
        (None: not kept) as their pages. True when its batch differs from the last step's (a
        turnover, counted)."""
        known, ps = self._known, self._ps
        if page_lists is None:
            for rid, n, s in zip(rids, seq_lens, slots, strict=True):
                known[rid] = (n, s // ps, None)
        else:
            for rid, n, s, pages in zip(rids, seq_lens, slots, page_lists, strict=True):
                known[rid] = (n, s // ps, pages)
        rids = list(rids)
        turnover = self._last != rids
        if turnover:
            self._last = rids
            self.turnovers += 1
        return turnover
