"""The authors' TBT metric and SLO goodput, on hand-built results."""

from __future__ import annotations

import pytest

from simulator.engine_types import SimResult
from simulator.metrics import authors_tbt_met, compute_metrics
from simulator.profile import load_profile
from simulator.state import FINISHED, REJECTED, SimRequest
from simulator.trace import TraceRequest
from tests.simulator.helpers import A5000


def done(rid: str, arrival: float, steps: list[float], slo: float = 100.0,
         ttft_slo: float = 5000.0, gaps: list[float] | None = None) -> SimRequest:
    """A finished request whose tokens came from steps of ``steps`` ms; wall-clock delivery
    gaps ``gaps`` (default: the step durations, i.e. no waiting between its steps)."""
    r = SimRequest(TraceRequest(rid, arrival, 100, len(steps), ttft_slo, slo))
    r.state = FINISHED
    r.step_ms = list(steps)
    t = arrival + steps[0]
    r.gen_ms = [t]
    for g in (gaps if gaps is not None else steps[1:]):
        t += g
        r.gen_ms.append(t)
    r.deliver_ms = list(r.gen_ms)
    r.burst = [False] * len(steps)
    r.finish_ms = r.gen_ms[-1]
    return r


def test_authors_metric_counts_step_durations_not_wall_clock_gaps() -> None:
    """Scenario: 5 tokens; steps 1000 (prefill), 50, 50, 300, 50 ms; the request also waited
    2 s paused before its 3rd token. Authors' metric: first token + 3 of 4 steps <= 100 ms = 4;
    our wall-clock metric misses the paused gap too (2 of 4)."""
    r = done("a", 0.0, [1000.0, 50.0, 50.0, 300.0, 50.0], gaps=[50.0, 2050.0, 300.0, 50.0])
    assert authors_tbt_met(r, deposit=False) == 4
    prof = load_profile(A5000)
    m = compute_metrics(SimResult("p", prof, [r]))
    assert m.tbt_attainment_authors == pytest.approx(4 / 5)
    assert m.tbt_attainment == pytest.approx(2 / 4)


def test_authors_metric_replays_the_deposit_on_the_step_axis() -> None:
    """With a deposit, fast steps bank tokens that cover a slow one: steps 10 x 20 ms then one
    of 150 ms at a 100 ms SLO -> all on time replayed; without the replay the slow step misses."""
    r = done("a", 0.0, [500.0] + [20.0] * 10 + [150.0])
    assert authors_tbt_met(r, deposit=True) == 12
    assert authors_tbt_met(r, deposit=False) == 11


def test_slo_goodput_counts_ttft_and_tbt_and_rejections_fail() -> None:
    """Goodput: a (TTFT ok, all gaps ok) counts; b (TTFT miss) does not; c (85% gaps ok < 90%)
    does not; a rejected request does not, but is counted as a request."""
    a = done("a", 0.0, [100.0] + [50.0] * 9)
    b = done("b", 0.0, [9000.0] + [50.0] * 9)
    c = done("c", 0.0, [100.0] + [50.0] * 17 + [300.0] * 3)  # 17 of 20 gaps ok = 85%
    rej = SimRequest(TraceRequest("r", 0.0, 100, 10, 5000.0, 100.0))
    rej.state = REJECTED
    prof = load_profile(A5000)
    m = compute_metrics(SimResult("p", prof, [a, b, c, rej]))
    assert m.slo_ok == 1 and m.rejected == 1
    span_min = max(a.finish_ms, b.finish_ms, c.finish_ms) / 60_000.0  # all arrive at 0
    assert m.slo_goodput_req_per_min == pytest.approx(1 / span_min)
    # negative control: c with 90% of its gaps on time counts
    c2 = done("c", 0.0, [100.0] + [50.0] * 18 + [300.0] * 2)
    assert compute_metrics(SimResult("p", prof, [a, b, c2, rej])).slo_ok == 2


def test_slo_goodput_window_is_the_offered_trace() -> None:
    """With arrivals spread over 2 minutes, goodput is per minute of that window, whatever the
    makespan: a policy that also serves a late straggler is not penalised for it."""
    prof = load_profile(A5000)
    a = done("a", 0.0, [100.0] + [50.0] * 9)
    b = done("b", 120_000.0, [100.0] + [50.0] * 9)
    slow = done("s", 60_000.0, [100.0] + [5000.0] * 9)  # misses TBT, finishes last
    m = compute_metrics(SimResult("p", prof, [a, b, slow]))
    assert m.slo_ok == 2 and m.slo_goodput_req_per_min == pytest.approx(1.0)
    assert m.throughput_req_per_min < 3 / 2.0  # the makespan is longer than the window


def test_a_long_pause_is_one_late_gap_but_fails_the_tpot_goodput() -> None:
    """A request that waits 10 s once among 20 gaps of 50 ms (a pause) keeps 95% of its gaps on
    time, so it counts toward the gap-based SLO goodput; its TPOT (~548 ms at a 100 ms SLO) fails
    the TTFT+TPOT goodput (DistServe's per-request test, eLLM §6.4). Controls: without the pause it
    counts in both; with a late TTFT it counts in neither."""
    prof = load_profile(A5000)
    paused = done("p", 0.0, [100.0] + [50.0] * 20, gaps=[50.0] * 9 + [10_000.0] + [50.0] * 10)
    m = compute_metrics(SimResult("p", prof, [paused]))
    assert m.slo_ok == 1 and m.slo_ok_tpot == 0 and m.tpot_attainment == 0.0
    assert m.slo_goodput_tpot_req_per_min == 0.0 < m.slo_goodput_req_per_min
    steady = done("s", 0.0, [100.0] + [50.0] * 20)
    m = compute_metrics(SimResult("p", prof, [steady]))
    assert m.slo_ok == m.slo_ok_tpot == 1
    assert m.slo_goodput_tpot_req_per_min == pytest.approx(m.slo_goodput_req_per_min)
    late = done("l", 0.0, [9000.0] + [50.0] * 20)
    assert compute_metrics(SimResult("p", prof, [late])).slo_ok_tpot == 0
