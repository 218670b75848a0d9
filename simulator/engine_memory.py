"""GPU memory of the engine: what requests hold, lazy eviction of paused layers, room for a
prefill, the decode step's peak and the memory safety net (a mixin of :class:`Engine`, which owns
the request lists and the profile)."""

from __future__ import annotations

from simulator.state import PAUSED, QUEUED, SimRequest


class EngineMemory:
    """Memory mechanisms over ``self.running``, ``self.paused``, ``self.queue``, ``self.p``."""

    def _kvb(self, r: SimRequest) -> int:
        """Blocks per layer the request keeps (eLLM drops its uncached prefix)."""
        if r.uncached_ratio > 0:
            return self.p.blocks(max(1, r.context - int(r.context * r.uncached_ratio)))
        return r.blocks(self.p)

    def _held(self, r: SimRequest) -> int:
        return 0 if r.resident is None else self._kvb(r) * sum(r.resident)

    def used_blocks(self) -> int:
        """Blocks held right now (resident layers of running, paused requests)."""
        return sum(self._held(r) for r in self.running) + sum(self._held(r) for r in self.paused)

    def _evict_paused(self, need: int) -> tuple[int, int]:
        """Evict paused layers (largest request first, last layer first) until ``need`` blocks
        are free or nothing is left; returns (blocks evicted, blocks still missing)."""
        evicted = 0
        for r in sorted(self.paused, key=lambda r: (-self._held(r), r.id)):
            if need <= 0:
                break
            if r.resident is None:
                continue
            b = r.blocks(self.p)
            row = list(r.resident)
            for layer in range(len(row) - 1, -1, -1):
                if need <= 0:
                    break
                if row[layer]:
                    row[layer] = 0
                    need -= b
                    evicted += b
            r.resident = tuple(row) if any(row) else None
        self.res.evicted_blocks += evicted
        self._evict_due += evicted  # written back during the next step (Engine._decode_step)
        return evicted, max(0, need)

    def _make_room(self, b: int, gpu_layers: int, pending: int) -> tuple[int | None, float]:
        """Room for a prompt of ``b`` blocks per layer keeping ``gpu_layers`` layers (plus one
        staging layer unless all stay), next to ``pending`` blocks of this step's earlier
        admissions. Returns (layers it keeps, or None when it cannot start; serial D2H ms).

        Order: evict paused layers (OrbitFlow §3.4); a layered policy then offloads at prefill
        the prompt layers that do not fit (§5.1: admission by batch limits, not memory); only
        when not even its staging layer fits are running requests' layers written back (their
        placements are re-planned next step; counted in ``admission_demoted_blocks``).
        """
        p = self.p
        budget = p.gpu_kv_budget_blocks

        def need(x: int) -> int:
            return b * (x + (0 if x == p.layers else 1))

        free = budget - self.used_blocks() - pending
        if need(gpu_layers) > free:
            self._evict_paused(need(gpu_layers) - free)
            free = budget - self.used_blocks() - pending
        if need(gpu_layers) > free and self.policy.layered:
            gpu_layers = max(0, min(p.layers - 1, free // b - 1))
        ms = 0.0
        if need(gpu_layers) > free and self.policy.layered:
            freed = self._demote_running(need(gpu_layers) - free)
            free += freed
            ms = freed / p.d2h_blocks_per_ms
        if need(gpu_layers) > free:
            return None, ms
        return gpu_layers, ms

    def _demote_running(self, missing: int) -> int:
        """Write back running requests' resident layers (largest holder first, last layer
        first) until ``missing`` blocks are free; returns the blocks freed."""
        freed = 0
        while freed < missing:
            holders = [r for r in self.running if r.resident is not None and any(r.resident)]
            if not holders:
                break
            r = max(holders, key=lambda x: (self._held(x), x.id))
            row = list(r.resident or ())
            layer = max(i for i, v in enumerate(row) if v)
            row[layer] = 0
            r.resident = tuple(row)
            if r.target is not None:
                r.target = tuple(a & t for a, t in zip(r.resident, r.target, strict=True))
            freed += self._kvb(r)
        self.res.admission_demoted_blocks += freed
        return freed

    def _force_fit(self) -> None:
        """Make the running batch fit memory (safety net; counted).

        Order (OrbitFlow §3.4, paused layers are evicted "when their space is actually
        needed"): first evict paused requests' layers, then defer running requests' promotions
        (they need a staging slot for one step; not a fallback), then the counted fallback.
        A running request is never starved of its promotions while a paused one keeps layers.
        """
        budget = self.p.gpu_kv_budget_blocks
        need = self._decode_peak()
        if need <= budget:
            return
        self._evict_paused(need - budget)
        if self._decode_peak() > budget:
            for r in self.running:  # no resident layer (None): every promotion deferred
                if r.target is not None:
                    now = r.resident if r.resident is not None else (0,) * len(r.target)
                    r.target = tuple(a & t for a, t in zip(now, r.target, strict=True))
        while True:
            need = self._decode_peak()
            if need <= budget:
                return
            _, missing = self._evict_paused(need - budget)
            if missing <= 0:
                continue
            self.res.forced_fallbacks += 1
            if self.policy.layered:
                victim = max(self.running, key=lambda r: (r.blocks(self.p) * sum(r.target), r.id))
                resident = sum(victim.target)
                if resident > 0:
                    rows = [row for row in self._cands.rows if sum(row) < resident]
                    row = max(rows, key=sum) if rows else tuple([0] * self.p.layers)
                    victim.target = row  # a victim with no resident layer gains none (its fetches are charged)
                    if victim.resident is not None:
                        victim.resident = tuple(a & b for a, b in zip(victim.resident, row, strict=True))
                    continue
                self.running.remove(victim)
                victim.state = PAUSED
                victim.pauses += 1
                self.paused.append(victim)
            else:
                victim = max(self.running, key=lambda r: (r.spec.arrival_ms, r.id))
                self.running.remove(victim)
                victim.state, victim.resident, victim.has_kv, victim.target = (
                    QUEUED, None, False, None)
                victim.preemptions += 1
                self.queue.insert(0, victim)
            if not self.running:
                return

    def _rows(self, r: SimRequest, demote_first: bool) -> tuple[int, ...]:
        """Residency a running request decodes with this step: its current layers, or (when
        demotions must free space first) only those it keeps."""
        cur = r.resident if r.resident is not None else tuple([0] * self.p.layers)
        if not demote_first or r.target is None:
            return cur
        return tuple(a & t for a, t in zip(cur, r.target, strict=True))

    def _decode_peak(self, demote_first: bool = True) -> int:
        """Peak GPU blocks of the next decode step (see :meth:`_rows`)."""
        return self._peaks()[1 if demote_first else 0]

    def _peaks(self) -> tuple[int, int]:
        """(peak keeping demoted layers during the step, peak demoting first)."""
        paused = sum(self._held(r) for r in self.paused)
        union_total = demote_total = paused
        for r in self.running:
            b = self._kvb(r)
            cur = r.resident
            tgt = r.target
            if cur is None:
                n = sum(tgt) if tgt is not None else 0
                union_total += b * (n + 1)
                demote_total += b * (n + 1)
                continue
            if tgt is None or tgt is cur or tgt == cur:
                n = sum(cur)
                extra = b * (n + (0 if n == len(cur) else 1))
                union_total += extra
                demote_total += extra
                continue
            union = 0
            keep = 0
            ntgt = 0
            for a, t in zip(cur, tgt, strict=True):
                union += a | t
                keep += a & t
                ntgt += t
            union_total += b * (union + (0 if all(cur) else 1))
            demote_total += b * (ntgt + (0 if keep == len(cur) else 1))
        return union_total, demote_total

