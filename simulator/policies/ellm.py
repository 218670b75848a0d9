"""``ellm``: eLLM's token-wise partial KV caching with request-level optimisation (eLLM §4.2).

Each step chooses the batch size ``b`` (running requests plus FCFS admissions) and one uncached
token ratio ``r`` for the batch by eLLM Eq. (5) subject to Eq. (1):

* objective: maximise ``b / T(b, r)`` (throughput);
* latency: ``T(b, r) <= SLO`` with ``T`` = the decode step (our profile's memory-bound model,
  which eLLM §6 notes its FLOP-only Eq. 3 underestimates) plus the recomputation of the uncached
  prefix of every request, Eq. (2) FLOPs on the prefill FLOP rate;
* memory: ``sum_i L * blocks(s_i * (1 - r)) <= budget`` (the cached suffix of every request).

eLLM solves this with SciPy's SLSQP; we search the same feasible set exhaustively on a grid
(``r`` in steps of 0.05, ``b`` over every FCFS prefix, incrementally: adding a request never makes
a prefix faster or smaller), which is exact up to the grid. The layer-level optimisation (kernel
fusion, comm/compute overlap, M_o) is not modelled: recomputation adds to the step.

Running requests (eLLM runs on vLLM, whose preemption it keeps): when the running batch's growing
KV fits memory only at a ratio whose recomputation breaks the SLO, the newest running requests
are preempted by recompute until the rest fits within the SLO (or at r = 0, when the step is
slow by context length alone, as the r = 0 baselines of :mod:`simulator.policies.slo_batch` also
keep running). Before issue 16 the batch instead kept running at the smallest ratio that fits
memory, up to r = 0.9, whatever the recomputation cost: past the memory-bound load its steps grew
to several times the SLO (ShareGPT on the A100 preset at 2x load, seed 1: 545 output tokens/s
against vllm-recompute's 1327, mean TTFT 69 s against 12 s). The oldest request always keeps
running.
"""

from __future__ import annotations

from simulator.policies.base import BasePolicy
from simulator.state import Actions, EngineView, SimRequest

RATIOS = tuple(i / 20 for i in range(19))  # 0.0 .. 0.9


class EllmPolicy(BasePolicy):
    name = "ellm"
    layered = False
    paused_hold_slot = False

    def max_tokens(self, profile) -> int:  # noqa: ANN001
        """Longest request servable: its cached suffix at the largest ratio must fit."""
        return min(profile.token_budget, int(profile.gpu_tokens_all_layers / (1 - RATIOS[-1])))

    def _recompute_ms(self, s: int, r: float) -> float:
        p = self.p
        rs = s * r
        flops = 24 * p.hidden**2 * p.layers * rs + 4 * p.hidden * p.layers * rs**2 \
            + 2 * p.hidden * p.vocab * rs
        return p.prefill_alpha * flops / (p.prefill_tflops * 1e12) * 1e3

    def _mem(self, reqs: list[SimRequest], r: float) -> int:
        p = self.p
        return sum(p.blocks(max(1, x.context + 1 - int((x.context + 1) * r))) for x in reqs) \
            * p.layers

    def _time(self, reqs: list[SimRequest], r: float) -> float:
        p = self.p
        tokens = sum(x.context for x in reqs)
        return p.decode_resident_ms(tokens) + sum(self._recompute_ms(x.context, r) for x in reqs)

    def _extend(self, col: tuple[list[int], list[float]], ctx: list[int], i: int,
                m: int) -> None:
        """Extend ``col``, the prefix sums over the contexts ``ctx`` at ratio ``RATIOS[i]``
        (blocks of all layers next step, recompute ms as :meth:`_recompute_ms`; index m is the
        first m requests), up to ``m``."""
        p = self.p
        r = RATIOS[i]
        bs, layers = p.block_size, p.layers
        lin = 24 * p.hidden**2 * p.layers + 2 * p.hidden * p.vocab
        quad = 4 * p.hidden * p.layers
        k = p.prefill_alpha / (p.prefill_tflops * 1e12) * 1e3
        mem, rec = col
        for s in ctx[len(mem) - 1:m]:
            c = s + 1
            mem.append(mem[-1] + -(-max(1, c - int(c * r)) // bs) * layers)
            rs = s * r
            rec.append(rec[-1] + k * (lin * rs + quad * rs * rs))

    def _prefixes(self, order: list[SimRequest],
                  n_running: int) -> list[tuple[int | None, float, float]]:
        """For each prefix ``order[:m]`` (m = 1..): (index of the smallest ratio whose memory
        fits, or None; the step time at that ratio; the prefix's tightest SLO). The smallest
        fitting ratio is the fastest (recomputation only grows with r) and never decreases as
        the prefix grows, so each ratio's prefix sums are extended only as far as needed. Stops
        after the first prefix :meth:`decide` cannot use, as no longer one can be used either:
        one that fits at no ratio, or misses the SLO at a ratio > 0 or beyond the running
        requests (``n_running``)."""
        p = self.p
        budget = p.gpu_kv_budget_blocks
        cols: dict[int, tuple[list[int], list[float]]] = {}
        i = 0
        tokens = 0
        slo = float("inf")
        out: list[tuple[int | None, float, float]] = []
        ctx = [x.context for x in order]
        for m, x in enumerate(order, 1):
            tokens += ctx[m - 1]
            slo = min(slo, x.spec.slo_tbt_ms)
            while i < len(RATIOS):
                col = cols.setdefault(i, ([0], [0.0]))
                self._extend(col, ctx, i, m)
                if col[0][m] <= budget:
                    break
                i += 1
            if i == len(RATIOS):
                out.append((None, p.decode_resident_ms(tokens), slo))
                break
            t = p.decode_resident_ms(tokens) + cols[i][1][m]
            out.append((i, t, slo))
            if t > slo and (i > 0 or m > n_running):
                break
        return out

    def decide(self, view: EngineView) -> Actions:
        p = self.p
        running = sorted(view.running, key=lambda x: (x.spec.arrival_ms, x.id))
        cands: list[SimRequest] = []
        tokens = sum(x.context for x in running)
        for q in view.queued:
            if len(running) + len(cands) + 1 > p.max_batch_size:
                break
            if tokens + q.context > p.token_budget and (running or cands):
                break
            cands.append(q)
            tokens += q.context
        pre = self._prefixes(running + cands, len(running))
        act = Actions()
        n = len(running)
        # Running requests: keep the longest prefix (oldest first) whose memory fits at a ratio
        # the SLO allows (or at r = 0: a step slow by length alone is not eLLM's to fix, as for
        # the r = 0 baselines); preempt the newest beyond it by recompute (vLLM's default, which
        # eLLM runs on). The oldest always keeps running.
        keep = n
        for m in range(1, n + 1):
            ri, t, slo = pre[m - 1] if m - 1 < len(pre) else (None, 0.0, 0.0)
            if ri is None or (ri > 0 and t > slo):
                keep = max(1, m - 1)
                break
        act.preempt_recompute = [x.id for x in running[keep:]]
        # Admissions: eLLM Eq. (5), the FCFS prefix maximising b / T(b, r) under the SLO.
        best: tuple[float, int] | None = None  # (throughput, batch size)
        if keep == n:
            for m in range(max(1, n), len(pre) + 1):
                ri, t, slo = pre[m - 1]
                if ri is None or t > slo:
                    break  # longer prefixes are slower and larger
                if best is None or m / t > best[0] + 1e-12:
                    best = (m / t, m)
        if best is not None:
            m = best[1]
        elif n == 0 and cands:
            m = 1  # an idle server takes its head, at the smallest ratio that fits memory
        else:
            m = keep
        ri = pre[m - 1][0] if 0 < m <= len(pre) else None
        ratio = RATIOS[ri] if ri is not None else RATIOS[-1]
        chosen = (running + cands)[:m]
        act.admit = [q.id for q in chosen[n:]]
        for x in chosen:
            act.uncached_ratio[x.id] = ratio
        return act
