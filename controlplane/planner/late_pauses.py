"""Pauses decided after the planner's time budget ran out, in O(log R) searches.

Within its budget the planner pauses one victim at a time and searches the rest after each
(OrbitFlow §3.4's pause loop). Each search costs O(R) or more, so a batch that needs many pauses
past the budget took O(R²): 32 s for 16,384 requests x 16 layers at a 40 ms budget, minutes
beyond, holding the control plane's what-if gate all the while. Past the budget,
:func:`late_pause_count` finds how many more victims (in victim order) to pause by doubling,
then bisection: pausing more leaves fewer requests and less KV, so a search's verdict turns from
none to a plan once, where the loop's would. Where it does not (a search that gives up on a larger
batch but not a smaller one) this may pause more than the loop (512 requests x 4 layers: 96
against 84): a plan that fits, late. So it serves only batches with more than
:data:`LATE_BISECT_MIN` requests left, where the loop's cost is quadratic; smaller ones keep it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from controlplane.model import RequestSpec

T = TypeVar("T")

LATE_BISECT_MIN = 128
"""Requests left above which a plan out of time bisects its pauses instead of looping."""


def late_pause_count(
    reqs: Sequence[RequestSpec], rest: Sequence[RequestSpec], search: Callable[[tuple[RequestSpec, ...]], T | None]
) -> tuple[int, T | None]:
    """``reqs`` have no plan; ``rest``: the next victims, in order, all in ``reqs``. Returns the
    fewest leading victims of ``rest`` whose pausing lets ``search`` plan the others, with that
    plan (``len(rest)`` and None when none does)."""
    n = len(rest)

    def attempt(m: int) -> T | None:
        gone = {v.id for v in rest[:m]}
        left = tuple(r for r in reqs if r.id not in gone)
        return search(left) if left else None

    lo, hi, found = 0, 1, None  # lo: a count known to leave no plan
    while hi < n:
        found = attempt(hi)
        if found is not None:
            break
        lo, hi = hi, min(n, 2 * hi)
    # found: a plan at hi; or hi == n, which pauses everyone (no plan needed, None)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        got = attempt(mid)
        if got is not None:
            hi, found = mid, got
        else:
            lo = mid
    return hi, found
