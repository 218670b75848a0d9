"""Pause-victim rules (OrbitFlow §3.4 and ``Policy.victim_rule``), used by the starvation guard.

The planner applies the same rules when a batch is infeasible; the controller needs them when it
must pause someone else so that a starving request can run.

* ``largest``: the largest ``blocks + deposit_tokens`` (the paper's rule: frees the most memory
  and masks the most violations for the victim through its deposit).
* ``longest`` / ``shortest``: the most / fewest context tokens.
* ``random``: uniform, seeded (deterministic for a given seed).
* ``lost-first``: ``largest`` among the candidates given; the controller first narrows them to
  the requests whose TPOT SLO is already lost (:func:`tpot_lost`), and the starvation guard
  pauses no other one.

Whatever the rule, a running request about to finish (the planner's ``about_to_finish`` on its
``remaining_tokens``) is chosen only when every candidate is (as the planner
orders its victims): it frees its KV by finishing, and the data plane would not pause it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from controlplane.controller.schedulers.base import RequestView
from controlplane.planner.planner import about_to_finish
from controlplane.policy import VICTIM_RULES


def finishing(r: RequestView) -> bool:
    """``r`` runs and is about to finish (the planner's rule on its ``remaining_tokens``)."""
    return not r.paused and about_to_finish(r.remaining_tokens)


def select_victim(
    candidates: Sequence[RequestView], rule: str, block_size: int, seed: int = 0
) -> RequestView:
    """The request ``rule`` pauses first among ``candidates`` (ties broken by id)."""
    if not candidates:
        raise ValueError("select_victim: no candidates")
    candidates = [r for r in candidates if not finishing(r)] or list(candidates)
    if rule in ("largest", "lost-first"):
        return max(
            candidates,
            key=lambda r: (r.blocks_per_layer(block_size) + r.deposit_tokens, r.id),
        )
    if rule == "longest":
        return max(candidates, key=lambda r: (r.context_tokens, r.id))
    if rule == "shortest":
        return min(candidates, key=lambda r: (r.context_tokens, r.id))
    if rule == "random":
        ordered = sorted(candidates, key=lambda r: r.id)
        return random.Random(seed).choice(ordered)
    raise ValueError(f"victim_rule: {rule!r} is not one of {VICTIM_RULES}")


def tpot_lost(r: RequestView, now_ms: float, floor_ms: float) -> bool:
    """Whether ``r`` misses its TPOT SLO whatever happens from ``now_ms`` on (LayerKV Eq. 1's
    budget ``T_tpot (N_past + N_future) - (T_past + T_future)`` below zero with ``T_future`` at
    the all-resident step ``floor_ms``, the fastest any step can be, and ``N_future`` up to
    ``max_new_tokens``): ``T_past + (N - n) floor > slo (N - 1)``. When the SLO is above the floor
    this is a proof for any output length up to ``N`` (the left side minus the right grows as
    the length falls); without a known ``max_new_tokens``, or with an SLO at or below the
    floor (met by no request), nothing is lost."""
    n = r.max_new_tokens
    if n is None or n < 2 or r.slo_tbt_ms <= floor_ms:
        return False
    t_past = max(0.0, now_ms - r.first_seen_ms)
    left = max(0, n - r.generated_tokens)
    return t_past + left * floor_ms > r.slo_tbt_ms * (n - 1)
