"""SLO-aware token deposit (OrbitFlow §3.2): decouple token generation from its delivery.

Rule (pure logic; time is explicit, in ms on the caller's clock):

* Generated tokens are appended to a FIFO (the deposit).
* The first token of a request is delivered as soon as it is generated (TTFT is not paced).
* While the deposit is non-empty, exactly one token is delivered per SLO interval: token ``i`` is
  delivered at ``d_i = max(g_i, d_{i-1} + slo)`` where ``g_i`` is its generation time. Tokens that
  arrive early wait for the delivery clock and form the reserve that later hides stalls.
* If the deposit is empty when a token is due, the next token is delivered as soon as it is
  generated; when that is later than ``d_{i-1} + slo`` the user sees an SLO violation.
* While the request is paused nothing is generated and the deposit keeps draining.
* When the request finishes, every remaining token is delivered at once (a burst).

The same class serves the controller (deposit balance for the planner's late-fraction bound,
OrbitFlow §3.3.1), the simulator and the SGLang streaming pacer. Invariants (property-tested):
the balance is never negative, deliveries are in generation order, never precede generation, and
consecutive deliveries before the finish burst are at least one SLO interval apart.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Delivery:
    """One token handed to the user."""

    index: int
    """0-based output token index."""
    generated_ms: float
    """When the token was generated."""
    delivered_ms: float
    """When it is delivered to the user."""
    violation: bool
    """True when this delivery came later than one SLO interval after the previous one."""
    burst: bool = False
    """True when delivered by the finish burst."""


class TokenDeposit:
    """The token deposit of one request. Not thread-safe: one owner advances it."""

    def __init__(
        self,
        slo_tbt_ms: float,
        *,
        delivered_tokens: int = 0,
        last_delivery_ms: float | None = None,
    ) -> None:
        """A deposit; ``delivered_tokens``/``last_delivery_ms`` join a stream already under way
        (tokens generated before the owner saw the request count as delivered, the last at
        ``last_delivery_ms``, so pacing continues from there)."""
        self._slo_ms = _check_slo(slo_tbt_ms)
        if (
            isinstance(delivered_tokens, bool)
            or not isinstance(delivered_tokens, int)
            or delivered_tokens < 0
        ):
            raise ValueError(
                f"delivered_tokens: expected an integer >= 0, got {delivered_tokens!r}"
            )
        if (last_delivery_ms is None) != (delivered_tokens == 0):
            raise ValueError(
                "last_delivery_ms: must be given exactly when delivered_tokens > 0 "
                f"(got {last_delivery_ms!r} with delivered_tokens={delivered_tokens})"
            )
        self._pending: deque[list] = deque()
        """Runs ``[generated_ms, count]`` of deposited tokens, oldest first (a report generates
        several tokens at one time: one entry, not one per token); the head token's index is
        :attr:`delivered`."""
        self._balance = 0
        self._last_delivery_ms: float | None = None
        self._now_ms = -math.inf
        if last_delivery_ms is not None:
            self._tick(last_delivery_ms)
            self._last_delivery_ms = float(last_delivery_ms)
        self._generated = delivered_tokens
        self._delivered = delivered_tokens
        self._violations = 0
        self._finished = False

    # ---- queries -------------------------------------------------------------------------
    @property
    def slo_tbt_ms(self) -> float:
        """Current delivery interval (the request's TBT SLO)."""
        return self._slo_ms

    @property
    def balance(self) -> int:
        """Tokens generated but not yet delivered (``deposit_tokens`` for the planner); >= 0."""
        return self._balance

    @property
    def generated(self) -> int:
        """Tokens generated so far."""
        return self._generated

    @property
    def delivered(self) -> int:
        """Tokens delivered so far."""
        return self._delivered

    @property
    def violations(self) -> int:
        """User-visible SLO violations so far (late deliveries with an empty deposit)."""
        return self._violations

    @property
    def finished(self) -> bool:
        """True once :meth:`finish` was called."""
        return self._finished

    @property
    def last_delivery_ms(self) -> float | None:
        """When the last token was delivered, or None before the first."""
        return self._last_delivery_ms

    def next_delivery_ms(self) -> float | None:
        """When the next deposited token is due, or None while the deposit is empty."""
        if not self._pending:
            return None
        gen_ms = self._pending[0][0]
        if self._last_delivery_ms is None:
            return gen_ms
        return max(gen_ms, self._last_delivery_ms + self._slo_ms)

    # ---- updates -------------------------------------------------------------------------
    def set_slo(self, slo_tbt_ms: float) -> None:
        """Change the delivery interval (a policy update); applies from the next delivery."""
        self._slo_ms = _check_slo(slo_tbt_ms)

    def advance(self, now_ms: float, *, deliveries: bool = True) -> list[Delivery]:
        """Deliver every token due at or before ``now_ms``; returns them in order (``deliveries``
        False: only the account moves, no :class:`Delivery` is built -- the controller's use)."""
        self._tick(now_ms)
        return self._deliver_due(now_ms, deliveries) if self._pending else []

    def generate(self, now_ms: float, n: int = 1, *, deliveries: bool = True) -> list[Delivery]:
        """Append ``n`` tokens generated at ``now_ms``; returns the deliveries due by then
        (``deliveries`` False: none built, as :meth:`advance`)."""
        if type(n) is not int or n < 0:  # bool is not int here
            raise ValueError(f"n: expected an integer >= 0, got {n!r}")
        if self._finished:
            raise ValueError("generate: the request already finished")
        self._tick(now_ms)
        pending = self._pending
        if n:  # the new tokens queue behind the deposited ones: one pass delivers what is due
            gen_ms = float(now_ms)
            if pending and pending[-1][0] == gen_ms:
                pending[-1][1] += n
            else:
                pending.append([gen_ms, n])
            self._generated += n
            self._balance += n
        return self._deliver_due(now_ms, deliveries) if pending else []

    def finish(self, now_ms: float, *, deliveries: bool = True) -> list[Delivery]:
        """The request finished at ``now_ms``: deliver what is due, then burst the remainder
        (``deliveries`` False: none built, as :meth:`advance`)."""
        out = self.advance(now_ms, deliveries=deliveries)
        at = float(now_ms)
        if self._balance:
            if deliveries:
                while self._pending:
                    out.append(self._deliver(at, burst=True))
            else:  # the account only: every remaining token at once, no violation
                self._delivered += self._balance
                self._balance = 0
                self._pending.clear()
                self._last_delivery_ms = at
        self._finished = True
        return out

    # ---- internals -----------------------------------------------------------------------
    def _tick(self, now_ms: float) -> None:
        # the clock is read on every advance: the usual case (a finite float, not going back)
        # is settled by one comparison chain (NaN fails it and takes the checks below)
        if type(now_ms) is float and self._now_ms <= now_ms < math.inf:
            self._now_ms = now_ms
            return
        if (
            isinstance(now_ms, bool)
            or not isinstance(now_ms, int | float)
            or not math.isfinite(now_ms)
        ):
            raise ValueError(f"now_ms: expected a finite number, got {now_ms!r}")
        if now_ms < self._now_ms:
            raise ValueError(f"now_ms: {now_ms} is before the last time seen ({self._now_ms})")
        self._now_ms = float(now_ms)

    def _deliver_due(self, now_ms: float, keep: bool = True) -> list[Delivery]:
        """Deliver the deposited tokens due at or before ``now_ms`` (clock already ticked)."""
        out: list[Delivery] = []
        pending = self._pending
        slo = self._slo_ms
        while pending:
            gen_ms = pending[0][0]
            last = self._last_delivery_ms
            due = gen_ms if last is None else max(gen_ms, last + slo)
            if due > now_ms:
                break
            if keep:
                got = self._deliver(due, burst=False)
                if got is not None:
                    out.append(got)
            else:
                self._deliver_run(now_ms, due)
        return out

    def _deliver_run(self, now_ms: float, due: float) -> None:
        """:meth:`_deliver` of the head run's tokens due by ``now_ms`` (the first at ``due``),
        building nothing: the same per-token arithmetic, without a call or an object per token.
        Past :data:`RUN_LOOP_MAX` tokens the rest is counted in closed form, so the work is
        bounded whatever a report claims (a jump of 10^12 tokens, an SLO of 1e-300 ms whose
        step does not move the clock): after the first token of a run each one is due exactly
        ``slo`` after the last (all share ``gen_ms <= due``), so none is a violation."""
        run = self._pending[0]
        gen_ms, left = run
        slo, limit = self._slo_ms, self._slo_ms * (1 + 1e-12)
        previous = self._last_delivery_ms
        violations = delivered = 0
        at = due
        while True:
            if previous is not None and at - previous > limit:
                violations += 1
            previous = at
            delivered += 1
            if delivered == left:
                break
            if delivered >= RUN_LOOP_MAX:
                # tokens at previous + k slo <= now_ms; all of them when a step of slo does not
                # move the clock in floating point (the loop would deliver them all at previous)
                due_more = math.inf if previous + slo == previous else (now_ms - previous) / slo
                more = left - delivered if due_more >= left - delivered else int(due_more)
                previous += more * slo
                delivered += more
                break
            at = max(gen_ms, previous + slo)
            if at > now_ms:
                break
        self._violations += violations
        self._delivered += delivered
        self._balance -= delivered
        self._last_delivery_ms = previous
        if delivered == left:
            self._pending.popleft()
        else:
            run[1] = left - delivered

    def _deliver(self, at_ms: float, *, burst: bool) -> Delivery:
        run = self._pending[0]
        gen_ms = run[0]
        index = self._delivered
        if run[1] == 1:
            self._pending.popleft()
        else:
            run[1] -= 1
        self._balance -= 1
        previous = self._last_delivery_ms
        # A visible violation: the gap exceeds the SLO because the deposit ran dry (the token was
        # generated after it was due). Burst deliveries and the first token never count.
        violation = (
            not burst and previous is not None and at_ms - previous > self._slo_ms * (1 + 1e-12)
        )
        if violation:
            self._violations += 1
        self._last_delivery_ms = at_ms
        self._delivered += 1
        return Delivery(index, gen_ms, at_ms, violation, burst)


RUN_LOOP_MAX = 4096
"""Tokens of one run :meth:`TokenDeposit._deliver_run` delivers one by one before it counts the
rest in closed form (the same figures but for rounding in the last bit of the delivery time)."""


def _check_slo(slo_tbt_ms: float) -> float:
    if (
        isinstance(slo_tbt_ms, bool)
        or not isinstance(slo_tbt_ms, int | float)
        or not math.isfinite(slo_tbt_ms)
        or slo_tbt_ms <= 0
    ):
        raise ValueError(f"slo_tbt_ms: {slo_tbt_ms!r} is out of range (allowed (0, inf))")
    return float(slo_tbt_ms)
