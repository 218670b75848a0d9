"""The SLO cap of OrbitFlow §3.3.1 with the token-deposit credit of §3.2 (issue 15 item 4).

§3.3.1: "Let sloFail_r denote whether request r violates the SLO in the current decode step ...
sum_r sloFail_r <= alpha", enforced "on the average over the next Δ steps":
``(1/Δ) sum_t sum_r sloFail_r <= alpha``. sloFail is binary: a request whose step is slower than
its SLO fails that step whatever the margin (every delivery gap is then T > slo).

A deposit (§3.2: tokens generated but not yet delivered, released one per SLO interval) masks
late steps until it drains. A step of T ms drains ``T / slo_r - 1`` deposited tokens (``T / slo_r``
delivered, one generated), so a deposit of D tokens keeps the first ``D / (T / slo_r - 1)`` steps
on time, and over Δ steps request r fails the share

    late_r(T) = 0                                    if T <= theta_r = slo_r (1 + D_r / Δ)
              = 1 - D_r / (Δ (T / slo_r - 1))        otherwise

of them (``theta_r``: the deposit covers the whole window exactly). The planner's cap is
``sum_r late_r <= alpha``. (Up to session 42 the cap was ``sum_r max(0, 1 - theta_r / T)``, the
share of owed tokens missing rather than of steps failed: it counted a request with no deposit at
1.5x its SLO as 1/3 late instead of late at every step, so alpha = 1 let three such requests run.)

**An SLO no placement can meet** (:func:`cap_view`). OrbitFlow's SLOs are multiples of a measured
decode step (§5.1; the reproductions use 1.5x and 2.5x), so there a request is late mostly
through its fetches, and pausing others frees the memory that makes it on time. A served SLO is milliseconds from a client or the
policy, and can lie below the step with every layer of every request on the GPU: the compute
sum, which the placement model holds whatever the batch. Counted as it is, such a request is
late in every plan, and the cap pauses requests -- on-time ones first when they are the largest
-- until at most alpha late ones run, though in the placement model (whose compute does not
depend on the batch) no pause makes any of them faster: two clients asking 10 ms of a 32 ms
model paused every other request. The cap therefore measures such a request from the
all-resident step: it is late when the placement makes it slower than that.
(``Plan.extras["late_fraction"]`` is the cap's left-hand side in this view.)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from controlplane.model import Batch, RequestSpec

_EPS = 1e-12
FLOOR_ROOM = 1e-9
"""Relative room above the all-resident step within which a raised SLO is met (:func:`cap_view`)."""


def max_step_ms(reqs: Sequence[RequestSpec], window: int, alpha: float, floor_ms: float) -> float:
    """The largest step time T whose late fraction at ``window`` is within alpha, or -1 when
    even ``floor_ms`` (the compute sum, a lower bound on any step) exceeds it; inf when no step
    time does (at most alpha requests in all).

    The late fraction is nondecreasing in T, constant 0 per request up to its ``theta_r`` and
    continuous after it (a jump to 1 there when the request has no deposit). The last threshold
    ``theta_k`` within alpha is found by bisection over the sorted thresholds; above it the late
    set is fixed and the crossing is bisected on that set's sum.
    """
    if late_fraction(reqs, floor_ms, window) > alpha + _EPS:
        return -1.0
    if len(reqs) <= alpha + _EPS:
        return math.inf
    thetas = sorted(covered_step_ms(r, window) for r in reqs)
    lo_i, hi_i = 0, len(thetas) - 1  # f(thetas[0]) = 0 <= alpha
    while lo_i < hi_i:
        k = (lo_i + hi_i + 1) // 2
        if late_fraction(reqs, thetas[k], window) <= alpha + _EPS:
            lo_i = k
        else:
            hi_i = k - 1
    start = thetas[lo_i]
    late = [r for r in reqs if covered_step_ms(r, window) <= start]  # late just above ``start``
    terms = [(r.slo_tbt_ms, r.deposit_tokens / window) for r in late]

    def over(t: float) -> bool:
        return sum(_late_one(t / s, c) for s, c in terms) > alpha + _EPS

    nxt = thetas[lo_i + 1] if lo_i + 1 < len(thetas) else math.inf
    lo: float = start
    hi: float = nxt
    if math.isinf(hi):  # the late set grows no more: its sum tends to |late| > alpha
        hi = max(2.0 * start, 1.0)
        while not over(hi):
            lo, hi = hi, 2.0 * hi
    for _ in range(200):  # f(lo) <= alpha < f(hi); stop at float resolution
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break
        if over(mid):
            hi = mid
        else:
            lo = mid
    return max(lo, floor_ms)


def covered_step_ms(r: RequestSpec, window: int) -> float:
    """The step time up to which ``r``'s deposit covers a window of ``window`` steps:
    ``theta_r = slo_r (1 + deposit_r / Δ)``."""
    return r.slo_tbt_ms * (1.0 + r.deposit_tokens / window)


def late_fraction(reqs: Sequence[RequestSpec], step_ms: float, window: int) -> float:
    """``sum_r late_r(T)``: the requests' shares of the window's Δ steps that fail their TBT SLO
    (OrbitFlow §3.3.1's ``(1/Δ) sum_t sum_r sloFail_r``, module docstring), the token deposit of
    §3.2 covering the first ``D_r / (T / slo_r - 1)`` of them."""
    if step_ms <= 0.0:  # a step of no time (a profile of zeros) is late for nobody
        return 0.0
    total = 0.0
    for r in reqs:
        if step_ms > covered_step_ms(r, window):
            total += _late_one(step_ms / r.slo_tbt_ms, r.deposit_tokens / window)
    return total


def _late_one(ratio: float, credit: float) -> float:
    """``1 - c / (T / slo - 1)`` for a step ``ratio = T / slo`` past ``1 + c`` (``c = D / Δ``),
    within [0, 1] whatever the rounding (no deposit: late at every step)."""
    if credit <= 0.0:
        return 1.0
    over = ratio - 1.0
    return 0.0 if over <= credit else 1.0 - credit / over


def largest_window(
    reqs: Sequence[RequestSpec], step_ms: float, alpha: float, lo: int, hi: int
) -> int | None:
    """Largest Δ in [lo, hi] whose late fraction at step time ``step_ms`` is within alpha.

    The late fraction depends on Δ only through ``deposit_r / Δ`` and grows with Δ (a fixed
    deposit is spread over more steps).
    """
    if lo > hi or late_fraction(reqs, step_ms, lo) > alpha + _EPS:
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if late_fraction(reqs, step_ms, mid) <= alpha + _EPS:
            lo = mid
        else:
            hi = mid - 1
    return lo


def floor_ms(layer_compute_ms: Sequence[float]) -> float:
    """The all-resident step with :data:`FLOOR_ROOM`: no placement, pause, admission or refill
    makes a step faster in the placement model, so an SLO below it is met at it."""
    return sum(layer_compute_ms) * (1.0 + FLOOR_ROOM)


def cap_view(batch: Batch, victims: list[RequestSpec]) -> tuple[Batch, list[RequestSpec]]:
    """The batch as the SLO cap sees it, and ``victims`` (ordered by the victim rule on the real
    requests) mapped onto its requests; the same objects when nothing changes (O(R)):

    * an SLO below :func:`floor_ms` is raised to it (module docstring; the room keeps a plan whose
      fetches all hide, one rounding error above the compute sum, on time), and that request's
      deposit counts 0: it drains one token per raw SLO and would be overcounted at the raised one;
    * without deposit credit (``policy.deposit_credit`` off) every deposit is 0.
    """
    floor = floor_ms(batch.profile.layer_compute_ms)
    credit = batch.policy.deposit_credit

    def seen(r: RequestSpec) -> RequestSpec:
        raised = r.slo_tbt_ms < floor
        deposit = r.deposit_tokens if credit and not raised else 0
        if not raised and deposit == r.deposit_tokens:
            return r
        return dataclasses.replace(r, deposit_tokens=deposit, slo_tbt_ms=max(r.slo_tbt_ms, floor))

    reqs = tuple(seen(r) for r in batch.requests)
    if all(a is b for a, b in zip(reqs, batch.requests, strict=True)):
        return batch, victims
    at = {id(r): i for i, r in enumerate(batch.requests)}
    return dataclasses.replace(batch, requests=reqs), [reqs[at[id(v)]] for v in victims]
