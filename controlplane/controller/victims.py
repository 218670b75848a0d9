"""Pause-victim rules (OrbitFlow §3.4 and ``Policy.victim_rule``), used by the starvation guard.

The planner applies the same rules when a batch is infeasible; the controller needs them when it
must pause someone else so that a starving request can run.

* ``largest``: the largest ``blocks + deposit_tokens`` (the paper's rule: frees the most memory
  and masks the most violations for the victim through its deposit).
* ``longest`` / ``shortest``: the most / fewest context tokens.
* ``random``: uniform, seeded (deterministic for a given seed).

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
    if rule == "largest":
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
