"""Exact step time and cheap lower bounds for candidate assignments.

:class:`Evaluator` binds one planning problem (blocks per request, per-layer compute, bandwidth,
candidate set) and answers, for an *assignment* (one candidate index per request):

* :meth:`Evaluator.exact_ms`: the exact issue 2 §2 timeline — the same event-driven algorithm as
  :func:`controlplane.model.step_time_ms` (tests check they agree), specialised to candidate
  layouts and with an optional ``cutoff`` that stops as soon as the step provably reaches it;
* :meth:`Evaluator.lower_bound_ms`: ``max(chain, aggregate)`` where

  - *chain* bound of request r: its own fetch chain with the whole link to itself. Fetch j starts
    when the layer that used the slot before has ended, so its stall is
    ``max(0, tau_r - window_j)`` independently of the other stalls (``tau_r = b_r / bw``,
    ``window_j`` the compute between the previous offloaded layer's end and this layer's start);
    sharing the link can only delay things, so ``T >= C + sum_j max(0, tau_r - window_j)``.
  - *aggregate* bound: every fetch for layers ``<= l`` lands before layer ``l`` starts and the link
    moves at most ``bw`` blocks/ms, so ``T >= W_l / bw + sum_{j >= l} comp_j``.

Both bounds are valid for the exact model, so pruning with them never loses the optimum.
"""

from __future__ import annotations

import functools
import heapq
import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from itertools import accumulate

from controlplane.model.grouped_timeline import link_served
from controlplane.planner.candidates import CandidateSet


@functools.lru_cache(maxsize=256)
def _windows(cands: CandidateSet, comp: tuple[float, ...]) -> list[tuple[list[float], list[float]]]:
    """Per candidate, its sorted compute windows before each fetch and their prefix sums."""
    prefix = [0.0, *accumulate(comp)]
    out = []
    for off in cands.offloaded:
        wins = []
        prev_end = 0  # index of the first layer after the previous offloaded layer
        for layer in off:
            wins.append(prefix[layer] - prefix[prev_end])
            prev_end = layer + 1
        wins.sort()
        out.append((wins, [0.0, *accumulate(wins)]))
    return out


@functools.lru_cache(maxsize=64)
def bound_layers(cands: CandidateSet) -> tuple[list[int], list[list[int]]]:
    # The aggregate term only peaks where some fetch lands, i.e. at offloaded layers; any subset
    # keeps the bound valid, at most ~24 keep it cheap.
    marks = sorted({layer for off in cands.offloaded[:-1] for layer in off} | {0})
    if len(marks) > 24:
        step = len(marks) / 24
        marks = sorted({marks[int(i * step)] for i in range(24)} | {marks[-1], 0})
    return marks, [[counts[layer] for layer in marks] for counts in cands.cumulative]


@functools.lru_cache(maxsize=4096)
def _event_layers(
    cands: CandidateSet, used: tuple[int, ...]
) -> list[tuple[int, list[tuple[int, int]]]]:
    """For the used candidates: each layer some of them offload, with the (candidate, next
    offloaded layer) pairs whose next fetch starts at that layer's end."""
    offl, nxt = cands.offloaded, cands.next_offloaded
    out = []
    for layer in sorted({layer for c in used for layer in offl[c]}):
        starters = [(c, nxt[c][layer]) for c in used if nxt[c][layer] >= 0 and layer in offl[c]]
        out.append((layer, starters))
    return out


class Evaluator:
    """Exact evaluation and lower bounds for one problem (blocks at the window's end)."""

    def __init__(
        self,
        cands: CandidateSet,
        blocks: Sequence[int],
        comp_ms: Sequence[float],
        bw_blocks_per_ms: float,
        chain_cache: dict[int, list[float]] | None = None,
        launch_ms: float = 0.0,
    ) -> None:
        """``chain_cache`` (b -> chain row) may be shared by evaluators of the same model,
        compute profile and bandwidth (e.g. the windows of one plan) to skip recomputation.
        ``launch_ms``: host cost of one fetch launch (:mod:`controlplane.model.timeline`); the
        bounds leave it out and stay valid: they rest on precedence (a layer starts after the
        layers before it and after its fetches, which the link serves at most at ``bw``), which
        launches only lengthen. The step time itself is not monotone in it: a launch that delays
        a competing fetch can leave the link to one needed sooner."""
        if not launch_ms >= 0:
            raise ValueError(f"launch_ms must be >= 0, got {launch_ms}")
        self.launch_ms = float(launch_ms)
        self.cands = cands
        self.blocks = list(blocks)
        self.comp = list(comp_ms)
        self.bw = float(bw_blocks_per_ms)
        self.n_layers = len(self.comp)
        prefix = [0.0, *accumulate(self.comp)]
        self.compute_ms = prefix[-1]
        # suffix[l]: compute of layers l..L-1 (what must still run once layer l may start).
        self.suffix = [self.compute_ms - p for p in prefix]
        self.mem = [[b * u for u in cands.mem_units] for b in self.blocks]
        cache = {} if chain_cache is None else chain_cache
        self.chain = []
        for b in self.blocks:
            row = cache.get(b)
            if row is None:
                row = cache[b] = self._chain_row(b / self.bw, prefix)
            self.chain.append(row)
        self.cum = cands.cumulative
        marks, self.bound_cum = bound_layers(cands)
        self.bound_layers = marks
        self.bound_suffix = [self.suffix[layer] for layer in marks]
        self.evaluations = 0
        self._prefix = prefix

    def _chain_row(self, tau: float, prefix: list[float]) -> list[float]:
        row = []
        for windows, sums in self._windows(prefix):
            n = bisect_left(windows, tau)
            row.append(self.compute_ms + n * tau - sums[n])
        return row

    def _windows(self, prefix: list[float]) -> list[tuple[list[float], list[float]]]:
        cached = getattr(self, "_win_cache", None)
        if cached is None:
            cached = _windows(self.cands, tuple(self.comp))
            self._win_cache = cached
        return cached

    # --- memory -------------------------------------------------------------------------
    def memory(self, assign: Sequence[int]) -> int:
        """Resident + staging blocks of an assignment."""
        mem = self.mem
        return sum(mem[r][c] for r, c in enumerate(assign))

    def split_memory(self, assign: Sequence[int]) -> tuple[int, int]:
        """(resident, staging) blocks of an assignment."""
        staging = sum(b for b, c in zip(self.blocks, assign, strict=True) if self.cands.counts[c])
        return self.memory(assign) - staging, staging

    # --- bounds -------------------------------------------------------------------------
    def aggregate_bound(self, assign: Sequence[int]) -> float:
        """``max_l W_l / bw + suffix[l]`` over the bound layers (and the all-on-GPU compute).

        Requests are summed per candidate first, so this costs O(R + candidates x marks).
        """
        per_cand: dict[int, int] = {}
        blocks = self.blocks
        for r, c in enumerate(assign):
            if c:
                per_cand[c] = per_cand.get(c, 0) + blocks[r]
        best = self.compute_ms
        if not per_cand:
            return best
        inv = 1.0 / self.bw
        out = list(self.bound_suffix)
        for c, w_blocks in per_cand.items():
            w = w_blocks * inv
            for i, k in enumerate(self.bound_cum[c]):
                if k:
                    out[i] += w * k
        return max(best, *out)

    def work(self, assign: Sequence[int]) -> list[float]:
        """Per bound layer, ``W_l / bw`` (fetch time of every transfer for layers <= l)."""
        out = [0.0] * len(self.bound_layers)
        inv = 1.0 / self.bw
        for r, c in enumerate(assign):
            if c:
                b = self.blocks[r] * inv
                for i, k in enumerate(self.bound_cum[c]):
                    out[i] += b * k
        return out

    def move_bound(
        self, work: Sequence[float], chain_other: float, r: int, old: int, new: int
    ) -> float:
        """Lower bound after moving request r from candidate ``old`` to ``new``.

        ``work`` is :meth:`work` of the current assignment, ``chain_other`` the largest chain
        bound among the other requests.
        """
        lb = max(chain_other, self.chain[r][new], self.compute_ms)
        b = self.blocks[r] / self.bw
        agg = max(
            [
                w + b * (n - o) + s
                for w, n, o, s in zip(
                    work, self.bound_cum[new], self.bound_cum[old], self.bound_suffix, strict=True
                )
            ]
        )
        return agg if agg > lb else lb

    def top_chains(self, assign: Sequence[int]) -> list[tuple[float, int]]:
        """The three largest (chain bound, request) pairs of ``assign``, padded with
        ``(compute_ms, -1)`` (what :meth:`move_bound` needs as ``chain_other``)."""
        chain = self.chain
        vals = sorted(((chain[r][c], r) for r, c in enumerate(assign)), reverse=True)
        vals += [(self.compute_ms, -1)] * 3
        return vals[:3]

    def lower_bound_ms(self, assign: Sequence[int]) -> float:
        """A valid lower bound on :meth:`exact_ms` (chain and aggregate bounds)."""
        chain = self.chain
        lb = max(chain[r][c] for r, c in enumerate(assign)) if assign else self.compute_ms
        return max(lb, self.aggregate_bound(assign))

    # --- exact --------------------------------------------------------------------------
    def exact_ms(self, assign: Sequence[int], cutoff: float = math.inf) -> float:
        """Exact step time (issue 2 §2); ``math.inf`` once it provably reaches ``cutoff``.

        Processor sharing gives every active stream the same service, so one virtual clock
        ``v`` (blocks served to each active stream) describes the link; a fetch of ``b`` blocks
        started at ``v0`` ends when ``v = F = v0 + b``. With the active ``F`` sorted
        (``F_1 <= ... <= F_n``) and prefix sums ``S_j``, moving ``v`` to ``V`` takes
        ``(S_j + V (n - j) - n v) / bw`` ms, ``j = #{F_i <= V}``, so each layer costs O(n) in C
        (sort, prefix sums) plus O(log n) Python steps instead of a heap event per fetch.
        Fetches start only at layer ends and stalls only happen at offloaded layers, so only
        those layers are visited; the compute in between is a prefix-sum difference.
        """
        self.evaluations += 1
        blocks = self.blocks
        by_cand: dict[int, list[float]] = {}
        for r, c in enumerate(assign):
            if c:
                lst = by_cand.get(c)
                if lst is None:
                    by_cand[c] = [float(blocks[r])]
                else:
                    lst.append(float(blocks[r]))
        if not by_cand:
            return self.compute_ms
        key = tuple(sorted(by_cand))
        events = _event_layers(self.cands, key)
        offl = self.cands.offloaded
        n_layers = self.n_layers
        need = [0.0] * n_layers  # largest F among the fetches layer l waits for
        fs: list[float] = []
        for c, bl in by_cand.items():
            need[offl[c][0]] = max(need[offl[c][0]], max(bl))
            fs.extend(bl)
        fs.sort()
        prefix, suffix, comp, bw = self._prefix, self.suffix, self.comp, self.bw
        launch = self.launch_ms
        # launch time before the next layer starts (transfers flow): the first fetches' launches
        delay = launch * len({offl[c][0] for c in by_cand}) if launch else 0.0
        v = 0.0
        t = 0.0
        pos = 0
        for layer, starters in events:
            # launches, then compute of layers pos..layer-1: no stalls, transfers progress
            dt = prefix[layer] - prefix[pos] + delay
            delay = 0.0
            for step in (0, 1):
                if step == 1:
                    # stall until layer's fetches landed, then run it
                    target = need[layer]
                    if target > v:
                        j = bisect_right(fs, target)
                        n = len(fs)
                        t += (sum(fs[:j]) + target * (n - j) - n * v) / bw
                        v = target
                        del fs[:j]
                    if t + suffix[layer] >= cutoff:
                        return math.inf
                    dt = comp[layer]
                if dt <= 0.0:
                    continue
                if fs:
                    v = link_served(fs, v, dt * bw)  # the blocks the link serves in dt
                t += dt
            # the slots used by this layer are free: start each owner's next fetch
            if starters:
                added = False
                for c, nl in starters:
                    bl = by_cand[c]
                    top = v + max(bl)
                    if top > need[nl]:
                        need[nl] = top
                    fs.extend([v + b for b in bl])
                    added = True
                if added:
                    fs.sort()
                if launch:  # one launch per target layer
                    delay = launch * len({nl for _, nl in starters})
            pos = layer + 1
        return t + prefix[n_layers] - prefix[pos]

    def exact_heap_ms(self, assign: Sequence[int], cutoff: float = math.inf) -> float:
        """Exact step time by an event heap (the reference for :meth:`exact_ms`; slower).

        Requests with the same candidate and the same ``b_r`` start and finish every fetch
        together, so they are simulated as one stream of multiplicity ``k`` (it counts ``k``
        times in the processor-sharing divisor). Fetches only start at layer ends: at the end of
        layer ``l`` every group whose candidate offloads ``l`` starts its next fetch.
        """
        self.evaluations += 1
        blocks = self.blocks
        keys: dict[tuple[int, int], int] = {}
        for r, c in enumerate(assign):
            if c:
                key = (c, blocks[r])
                keys[key] = keys.get(key, 0) + 1
        if not keys:
            return self.compute_ms
        cands = self.cands
        offl, nxt_all = cands.offloaded, cands.next_offloaded
        n_layers = self.n_layers
        # groups by candidate: (b, k, gid); per-group multiplicity for pops
        by_cand: dict[int, list[tuple[float, int]]] = {}
        gk: list[int] = []
        heap: list[tuple[float, int, int]] = []
        waiting = [0] * n_layers
        per_cand_k: dict[int, int] = {}
        for (c, b), k in keys.items():
            g = len(gk)
            gk.append(k)
            by_cand.setdefault(c, []).append((float(b), g))
            per_cand_k[c] = per_cand_k.get(c, 0) + k
            heap.append((float(b), g, offl[c][0]))
        for c, k in per_cand_k.items():
            for layer in offl[c]:
                waiting[layer] += k
        heapq.heapify(heap)
        nact = len(assign) - sum(1 for c in assign if not c)
        at = cands.offloading_at
        comp, suffix, inv = self.comp, self.suffix, 1.0 / self.bw
        bw = self.bw
        push, pop = heapq.heappush, heapq.heappop
        launch = self.launch_ms
        delay = launch * len({offl[c][0] for c in per_cand_k})
        v = 0.0
        t = 0.0

        def flow(end: float) -> None:
            """Transfers keep flowing until ``end`` (a layer's compute, or launch time)."""
            nonlocal t, v, nact
            while heap:
                fv, g, dl = heap[0]
                t_done = t + (fv - v) * nact * inv
                if t_done > end:
                    v += (end - t) * bw / nact
                    break
                pop(heap)
                t, v = t_done, fv
                k = gk[g]
                nact -= k
                waiting[dl] -= k
            t = end

        for layer in range(n_layers):
            if delay:  # launch time: transfers flow, the layer has not started
                flow(t + delay)
                delay = 0.0
            if waiting[layer]:
                while waiting[layer] > 0:
                    fv, g, dl = pop(heap)
                    t += (fv - v) * nact * inv
                    v = fv
                    k = gk[g]
                    nact -= k
                    waiting[dl] -= k
            if t + suffix[layer] >= cutoff:
                return math.inf
            flow(t + comp[layer])
            targets = set()
            for c in at[layer]:
                groups = by_cand.get(c)
                if groups:
                    nl = nxt_all[c][layer]
                    if nl >= 0:
                        targets.add(nl)
                        for size, g in groups:
                            push(heap, (v + size, g, nl))
                            nact += gk[g]
            delay = launch * len(targets)
        return t
