"""Token deposit (OrbitFlow §3.2): worked cases and hypothesis properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.controller import TokenDeposit
from controlplane.controller.token_deposit import Delivery


def test_early_tokens_wait_for_the_delivery_clock() -> None:
    """Tokens generated early are delivered exactly one SLO interval apart (the reserve builds)."""
    d = TokenDeposit(100.0)
    first = d.generate(0.0)
    assert [x.delivered_ms for x in first] == [0.0]  # TTFT is not paced
    assert d.generate(30.0) == [] and d.generate(60.0) == []
    assert d.balance == 2
    assert d.next_delivery_ms() == 100.0
    out = d.advance(250.0)
    assert [(x.index, x.delivered_ms) for x in out] == [(1, 100.0), (2, 200.0)]
    assert d.balance == 0 and d.violations == 0


def test_empty_deposit_delivers_late_token_at_once_as_violation() -> None:
    """With an empty deposit the next token goes out when generated; late means a visible violation."""
    d = TokenDeposit(100.0)
    d.generate(0.0)
    out = d.generate(350.0)
    assert [(x.delivered_ms, x.violation) for x in out] == [(350.0, True)]
    assert d.violations == 1
    out = d.generate(420.0)  # early again: waits until 450
    assert out == [] and d.next_delivery_ms() == 450.0


def test_deposit_hides_a_stall() -> None:
    """Scenario: a reserve of 3 tokens absorbs a 250 ms stall without a visible violation."""
    d = TokenDeposit(100.0)
    for t in (0.0, 10.0, 20.0, 30.0):
        d.generate(t)
    assert d.balance == 3
    out = d.generate(330.0)  # stall: next token only at 330 (deposit delivered at 100, 200, 300)
    assert [x.delivered_ms for x in out] == [100.0, 200.0, 300.0]
    assert d.balance == 1 and d.violations == 0
    assert [x.delivered_ms for x in d.advance(400.0)] == [400.0]


def test_deposit_drains_while_paused() -> None:
    """While nothing is generated (a pause) the deposit keeps draining at the SLO rate."""
    d = TokenDeposit(50.0)
    d.generate(0.0, n=6)  # first delivered at once, 5 held
    out = d.advance(1000.0)
    assert [x.delivered_ms for x in out] == [50.0, 100.0, 150.0, 200.0, 250.0]
    assert d.balance == 0


def test_finish_bursts_the_remainder() -> None:
    """On finish every remaining token is delivered at the finish time, flagged as a burst."""
    d = TokenDeposit(100.0)
    d.generate(0.0, n=4)
    out = d.finish(120.0)
    assert [(x.delivered_ms, x.burst) for x in out] == [
        (100.0, False),
        (120.0, True),
        (120.0, True),
    ]
    assert d.balance == 0 and d.finished
    with pytest.raises(ValueError, match="finished"):
        d.generate(130.0)


def test_bad_inputs_name_the_field() -> None:
    """Bad SLO, count or time raise ValueError naming the field."""
    with pytest.raises(ValueError, match="slo_tbt_ms"):
        TokenDeposit(0.0)
    d = TokenDeposit(10.0)
    d.generate(5.0)
    with pytest.raises(ValueError, match="now_ms"):
        d.advance(4.0)
    with pytest.raises(ValueError, match="n:"):
        d.generate(6.0, n=-1)
    with pytest.raises(ValueError, match="now_ms"):
        d.advance(float("nan"))


ops = st.lists(
    st.tuples(
        st.sampled_from(["gen", "adv", "slo"]),
        st.floats(min_value=0.0, max_value=300.0, allow_nan=False),
        st.integers(min_value=0, max_value=3),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(slo=st.floats(min_value=1.0, max_value=200.0), seq=ops, finish=st.booleans())
def test_deposit_invariants(slo: float, seq: list[tuple[str, float, int]], finish: bool) -> None:
    """Balance never negative; deliveries in order, never early, d_i = max(g_i, d_{i-1} + slo)."""
    d = TokenDeposit(slo)
    now = 0.0
    deliveries = []
    current_slo = slo
    for op, dt, n in seq:
        now += dt
        if op == "gen":
            out = d.generate(now, n)
        elif op == "adv":
            out = d.advance(now)
        else:
            current_slo = 1.0 + dt
            d.set_slo(current_slo)
            out = d.advance(now)
        for x in out:
            assert x.delivered_ms <= now
        deliveries += [(x, current_slo) for x in out]
        assert d.balance >= 0
        assert d.balance == d.generated - d.delivered
        nxt = d.next_delivery_ms()
        assert (nxt is None) == (d.balance == 0)
        if nxt is not None:
            assert nxt > now  # everything due has been delivered
    if finish:
        deliveries += [(x, current_slo) for x in d.finish(now)]
        assert d.balance == 0
    prev = None
    for i, (x, s) in enumerate(deliveries):
        assert x.index == i
        assert x.delivered_ms >= x.generated_ms
        if prev is None:
            assert x.delivered_ms == x.generated_ms  # first token is not paced
        elif x.burst:
            assert x.delivered_ms >= prev.delivered_ms
        else:
            # Exactly one per SLO interval while the deposit holds tokens; else at generation.
            expect = max(x.generated_ms, prev.delivered_ms + s)
            assert x.delivered_ms == pytest.approx(expect)
            assert x.violation == (x.delivered_ms - prev.delivered_ms > s * (1 + 1e-12))
        prev = x
    assert d.violations == sum(1 for x, _ in deliveries if x.violation)


def test_join_mid_stream_counts_history_as_delivered() -> None:
    """A deposit joining a stream under way paces from the last delivery; history is not re-held."""
    d = TokenDeposit(100.0, delivered_tokens=500, last_delivery_ms=1000.0)
    assert (d.generated, d.delivered, d.balance) == (500, 500, 0)
    assert d.generate(1010.0) == []  # paced: due at 1100
    (x,) = d.advance(1100.0)
    assert (x.index, x.delivered_ms) == (500, 1100.0)
    with pytest.raises(ValueError, match="last_delivery_ms"):
        TokenDeposit(100.0, delivered_tokens=3)


def _account(d: TokenDeposit) -> tuple:
    return (d.generated, d.delivered, d.violations, d.balance, d.last_delivery_ms, d.next_delivery_ms(), d.finished)


@given(slo=st.floats(min_value=1.0, max_value=200.0), seq=ops, finish=st.booleans())
def test_without_deliveries_the_account_is_the_same(slo: float, seq: list[tuple[str, float, int]], finish: bool) -> None:
    """``deliveries=False`` (the controller's use: no Delivery built) moves the account exactly as
    the default does, and returns nothing."""
    full, lean = TokenDeposit(slo), TokenDeposit(slo)
    now = 0.0
    for kind, dt, n in seq:
        now += dt
        if kind == "gen":
            full.generate(now, n)
            assert lean.generate(now, n, deliveries=False) == []
        elif kind == "slo":
            full.set_slo(max(1.0, dt))
            lean.set_slo(max(1.0, dt))
        else:
            full.advance(now)
            assert lean.advance(now, deliveries=False) == []
        assert _account(full) == _account(lean)
    if finish:
        full.finish(now + 1.0)
        assert lean.finish(now + 1.0, deliveries=False) == []
    assert _account(full) == _account(lean)


def test_the_account_comparison_sees_a_difference() -> None:
    """Negative control for the property above: one token more is a different account."""
    a, b = TokenDeposit(50.0), TokenDeposit(50.0)
    a.generate(0.0, 2)
    b.generate(0.0, 3, deliveries=False)
    assert _account(a) != _account(b)


class _PerTokenReference:
    """The deposit rule one token at a time (the implementation before runs), as the reference."""

    def __init__(self, slo: float) -> None:
        self.slo, self.pending, self.last, self.delivered, self.violations = slo, [], None, 0, 0

    def due(self, now: float) -> list[Delivery]:
        out = []
        while self.pending:
            index, gen = self.pending[0]
            at = gen if self.last is None else max(gen, self.last + self.slo)
            if at > now:
                break
            out.append(self._deliver(at, burst=False))
        return out

    def _deliver(self, at: float, burst: bool) -> Delivery:
        index, gen = self.pending.pop(0)
        late = not burst and self.last is not None and at - self.last > self.slo * (1 + 1e-12)
        self.violations += late
        self.last, self.delivered = at, self.delivered + 1
        return Delivery(index, gen, at, late, burst)

    def generate(self, now: float, n: int) -> list[Delivery]:
        out = self.due(now)
        base = self.delivered + len(self.pending)
        self.pending += [(base + i, float(now)) for i in range(n)]
        return out + (self.due(now) if n else [])

    def finish(self, now: float) -> list[Delivery]:
        out = self.due(now)
        while self.pending:
            out.append(self._deliver(float(now), burst=True))
        return out


@settings(max_examples=300, deadline=None)
@given(
    slo=st.floats(min_value=0.5, max_value=50.0),
    seq=st.lists(st.tuples(st.booleans(), st.sampled_from([0.0, 0.25, 1.0, 7.5, 40.0]), st.integers(0, 12)), max_size=50),
    keep=st.booleans(),
)
def test_runs_deliver_exactly_as_one_token_at_a_time(slo: float, seq: list, keep: bool) -> None:
    """Deposited tokens are kept as runs (one entry per generation time); every delivery -- its
    index, time, violation flag -- and the account equal the per-token rule's, with and without
    Delivery objects, including several tokens generated at one time and the finish burst."""
    ref, d = _PerTokenReference(slo), TokenDeposit(slo)
    now, got, want = 1000.0, [], []
    for gen, dt, n in seq:
        now += dt
        if gen:
            want += ref.generate(now, n)
            got += d.generate(now, n, deliveries=keep)
        else:
            want += ref.due(now)
            got += d.advance(now, deliveries=keep)
        assert (d.delivered, d.balance, d.violations, d.last_delivery_ms) == (
            ref.delivered, len(ref.pending), ref.violations, ref.last)
    want += ref.finish(now + 3.0)
    got += d.finish(now + 3.0, deliveries=keep)
    assert (d.delivered, d.balance, d.violations, d.last_delivery_ms) == (ref.delivered, 0, ref.violations, ref.last)
    if keep:
        assert got == want


def test_the_reference_comparison_sees_a_difference() -> None:
    """Negative control: a reference one SLO slower delivers differently."""
    ref, d = _PerTokenReference(20.0), TokenDeposit(10.0)
    assert ref.generate(0.0, 3) + ref.due(25.0) != d.generate(0.0, 3) + d.advance(25.0)
