"""The recompute option's candidate grid: which ``(u, k)`` the planner tries per request.

The contract is ``docs/recompute.md`` (issue 16; eLLM §4.3.1). Per request with ``b`` blocks the
planner may leave ``u <= U = min(floor(max_recompute_ratio * b), b - 1)`` leading blocks uncached
and recompute them through layers ``< k``. The grid is deliberately small (the joint space is
layouts x options per request):

* ``u`` in ``{U, ceil(U/2), ceil(U/4)}`` (distinct, > 0);
* ``k`` in ``{0, round(L/4), round(L/2), round(3L/4), L}`` plus the **balanced** ``k*``: the
  layer count at which recomputing the prefix through layers ``< k`` takes as long as fetching it
  for layers ``>= k`` over the whole link, ``argmin_k |bs * sum_{l<k} rms[l] - (L - k) / bw|``
  (eLLM §4.3.1: "minimizes the discrepancy between swapping latency and recombination overhead";
  both sides are linear in ``u``, so ``k*`` does not depend on ``u``);
* plus ``(0, 0)``, no recompute, always first.

So at most ``1 + 3 x 6 = 19`` options per request. The grid is offered only when the batch's
profile has ``recompute_ms_per_token`` and ``policy.max_recompute_ratio > 0``
(:meth:`RecomputeGrid.for_batch`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from controlplane.model import Batch

U_FRACTIONS = (1.0, 0.5, 0.25)
"""``u`` as fractions of the request's allowance ``U`` (rounded up, distinct, > 0)."""
K_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
"""``k`` as fractions of the depth ``L`` (rounded), besides the balanced ``k*``."""


@dataclass(frozen=True)
class RecomputeGrid:
    """The ``(u, k)`` candidates of one batch (model depth, profile, link, policy ratio)."""

    layers: int
    """Model depth L."""
    block_size: int
    """Tokens per block (``u`` blocks recompute ``u * block_size`` tokens)."""
    max_ratio: float
    """``policy.max_recompute_ratio``, in (0, 1)."""
    recompute_ms_per_token: tuple[float, ...]
    """Per layer, ms one recomputed token adds to the layer (``profile.recompute_ms_per_token``)."""
    bw_blocks_per_ms: float
    """Link bandwidth in blocks per ms (for the balanced ``k*``)."""
    u_fractions: tuple[float, ...] = U_FRACTIONS
    k_fractions: tuple[float, ...] = K_FRACTIONS

    def __post_init__(self) -> None:
        if len(self.recompute_ms_per_token) != self.layers:
            raise ValueError(
                f"recompute_ms_per_token has {len(self.recompute_ms_per_token)} entries, "
                f"expected {self.layers}"
            )
        if not 0.0 < self.max_ratio < 1.0:
            raise ValueError(f"max_ratio must be in (0, 1), got {self.max_ratio}")
        if not self.bw_blocks_per_ms > 0:
            raise ValueError(f"bw_blocks_per_ms must be > 0, got {self.bw_blocks_per_ms}")

    @classmethod
    def for_batch(cls, batch: Batch) -> RecomputeGrid | None:
        """The batch's grid, or None when recompute is not offered (no profile figure, or
        ``max_recompute_ratio == 0``)."""
        rms = batch.profile.recompute_ms_per_token
        if rms is None or not batch.offers_recompute:
            return None
        return cls(
            layers=batch.model.layers,
            block_size=batch.model.block_size,
            max_ratio=batch.policy.max_recompute_ratio,
            recompute_ms_per_token=tuple(rms),
            bw_blocks_per_ms=batch.bw_blocks_per_ms,
        )

    def max_blocks(self, blocks: int) -> int:
        """``U = min(floor(max_ratio * b), b - 1)`` (never negative)."""
        return max(0, min(math.floor(self.max_ratio * blocks), blocks - 1))

    @functools.cached_property
    def balanced_layers(self) -> int:
        """``k*``: recompute through layers ``< k*`` balances fetching layers ``>= k*`` (eLLM
        §4.3.1); the smallest such k on ties."""
        best_k, best_gap = 0, math.inf
        recompute_ms = 0.0  # per block, layers < k
        for k in range(self.layers + 1):
            gap = abs(recompute_ms - (self.layers - k) / self.bw_blocks_per_ms)
            if gap < best_gap:
                best_k, best_gap = k, gap
            if k < self.layers:
                recompute_ms += self.block_size * self.recompute_ms_per_token[k]
        return best_k

    @functools.cached_property
    def layer_choices(self) -> tuple[int, ...]:
        """The distinct ``k`` of the grid, ascending."""
        ks = {round(f * self.layers) for f in self.k_fractions} | {self.balanced_layers}
        return tuple(sorted(ks))

    def block_choices(self, blocks: int) -> tuple[int, ...]:
        """The distinct ``u > 0`` of the grid for a request of ``blocks`` blocks, descending."""
        cap = self.max_blocks(blocks)
        us = {math.ceil(f * cap) for f in self.u_fractions} - {0}
        return tuple(sorted(us, reverse=True))

    def options(self, blocks: int) -> tuple[tuple[int, int], ...]:
        """``(u, k)`` per option: ``(0, 0)`` first, then every ``u`` x every ``k``."""
        return ((0, 0),) + tuple(
            (u, k) for u in self.block_choices(blocks) for k in self.layer_choices
        )

    def recompute_ms(self, u: int, k: int) -> float:
        """Compute the prefix of ``u`` blocks adds over layers ``< k``."""
        return u * self.block_size * sum(self.recompute_ms_per_token[:k])

    def step_lower_bound_ms(
        self,
        blocks: Sequence[int],
        comp_ms: Sequence[float],
        budget_blocks: int,
    ) -> float:
        """A valid lower bound on the step time of any memory-feasible assignment **with** the
        recompute option (the planner's bound-based pausing; ``math.inf`` when even everything
        offloaded does not fit, which recompute cannot beat: every option takes >= ``b`` blocks).

        Memory forces ``V + X >= E = sum_r b_r L - budget`` block-layers off the GPU: ``V``
        fetched (``T >= V / bw + comp[L-1]``, every fetch lands before the last layer starts)
        or ``X`` recomputed (``T >= sum comp + X * bs * min_l rms[l]``), with
        ``X <= sum_r U_r L``. The larger of the two is least where they cross.
        """
        total = sum(comp_ms)
        if not blocks:
            return total
        if sum(blocks) > budget_blocks:
            return math.inf
        excess = sum(blocks) * self.layers - budget_blocks
        if excess <= 0:
            return total
        per_block_layer = self.block_size * min(self.recompute_ms_per_token)
        x_max = min(excess, sum(self.max_blocks(b) for b in blocks) * self.layers)
        inv = 1.0 / self.bw_blocks_per_ms
        last = comp_ms[-1]

        def both(x: float) -> float:
            return max(total + x * per_block_layer, (excess - x) * inv + last)

        # total + a x = (E - x)/bw + last  ->  x = (E/bw + last - total) / (a + 1/bw)
        cross = (excess * inv + last - total) / (per_block_layer + inv)
        x = min(max(cross, 0.0), float(x_max))
        return max(total, min(both(x), both(0.0), both(float(x_max))))
