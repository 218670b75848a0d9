"""The SLO cap of OrbitFlow §3.3.1 with the token-deposit credit of §3.2 (issue 15 item 4).

Violations are averaged over the decode window Δ (§3.3.1, "we enforce it on the average over the
next Δ steps") and a request's deposit (§3.2: tokens generated but not yet delivered, released
one per SLO interval) masks late steps until it drains. A step of T ms drains ``T / slo_r``
deposited tokens, so over Δ steps request r is late for the share
``max(0, 1 - slo_r (1 + deposit_r / Δ) / T)`` of its deliveries, and its deposit covers the
whole window exactly when ``deposit_r >= Δ (T / slo_r - 1)``, i.e. up to the step time
``covered_step_ms = slo_r (1 + deposit_r / Δ)``. The planner's cap is
``sum_r late_r <= alpha``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from controlplane.model import RequestSpec


def max_step_ms(reqs: Sequence[RequestSpec], window: int, alpha: float, floor_ms: float) -> float:
    """The largest step time T whose late fraction at ``window`` is within alpha, or -1 when
    even ``floor_ms`` (the compute sum, a lower bound on any step) exceeds it.

    Request r is late once ``T > theta_r = slo_r (1 + c_r)``, ``c_r = deposit_r / Δ`` (its
    deposit covers the window exactly at ``theta_r``, see :func:`late_fraction`). Between consecutive
    thresholds the late fraction is ``|A| - sum_A theta_r / T`` (A: the late ones), so the
    crossing with alpha, ``T = sum_A theta_r / (|A| - alpha)``, is solved per segment.
    """
    eps = 1e-12
    if late_fraction(reqs, floor_ms, window) > alpha + eps:
        return -1.0
    thetas = sorted(covered_step_ms(r, window) for r in reqs)
    late = 0  # |A|
    total = 0.0  # sum_A theta_r
    for i, theta in enumerate(thetas):
        late += 1
        total += theta
        nxt = thetas[i + 1] if i + 1 < len(thetas) else math.inf
        if late > alpha + eps:
            t = total / (late - alpha - eps)
            if t < nxt:
                return max(t, theta, floor_ms)
    return math.inf


def covered_step_ms(r: RequestSpec, window: int) -> float:
    """The step time up to which ``r``'s deposit covers a window of ``window`` steps:
    ``slo_r (1 + deposit_r / Δ)``."""
    return r.slo_tbt_ms * (1.0 + r.deposit_tokens / window)


def late_fraction(reqs: Sequence[RequestSpec], step_ms: float, window: int) -> float:
    """``sum_r max(0, 1 - slo_r (1 + deposit_r / Δ) / T)``: the SLO cap of OrbitFlow §3.3.1
    (violations averaged over the decode window Δ) with the token deposit of §3.2 as credit.

    Over Δ steps of T ms the user is owed ``Δ T / slo_r`` tokens (one per SLO interval) and gets
    the Δ generated plus the ``deposit_r`` already banked, so the late share of the window's
    deliveries is ``1 - slo_r (Δ + deposit_r) / (Δ T)``. A step of T ms drains ``T / slo_r``
    deposited tokens, not one: a deposit of D tokens covers the window exactly when
    ``D >= Δ (T / slo_r - 1)``. (The earlier form ``1 - slo_r / T - deposit_r / Δ`` counted
    one token per late step and over-credited the deposit by the factor ``T / slo_r``.)
    """
    if step_ms <= 0.0:  # a step of no time (a profile of zeros) is late for nobody
        return 0.0
    return sum(max(0.0, 1.0 - covered_step_ms(r, window) / step_ms) for r in reqs)


def largest_window(
    reqs: Sequence[RequestSpec], step_ms: float, alpha: float, lo: int, hi: int
) -> int | None:
    """Largest Δ in [lo, hi] whose late fraction at step time ``step_ms`` is within alpha.

    The late fraction depends on Δ only through ``deposit_r / Δ`` and grows with Δ (a fixed
    deposit is spread over more steps).
    """
    if lo > hi or late_fraction(reqs, step_ms, lo) > alpha + 1e-12:
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if late_fraction(reqs, step_ms, mid) <= alpha + 1e-12:
            lo = mid
        else:
            hi = mid - 1
    return lo
