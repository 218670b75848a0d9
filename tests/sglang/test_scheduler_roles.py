"""The scheduler hooks' roles on their own (no SGLang): decision inbox, step boundary, step reporter,
stats line. The server tests (pause, admission, LVF, outage, layered) cover them wired into SGLang."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from controlplane.api import Decision
from controlplane.model import Plan
from sglang_ext.admission import AdmissionGate
from sglang_ext.decision_inbox import DecisionInbox
from sglang_ext.pause import PauseManager
from sglang_ext.step_boundary import StepBoundary
from sglang_ext.step_reporter import StepReporter
from sglang_ext.step_stats_writer import StepStatsWriter, stats_dict
from sglang_ext.tp_sync import PlacementInstaller, TpSync

LAYERS = 2


def decision(expiry: int, **fields: Any) -> Decision:
    placements = fields.pop("placements", {})
    plan = Plan(True, (), placements, 1.0, 8, 0, 0, "test", 0.0)
    return Decision(plan=plan, apply_at_step=0, expiry_step=expiry, **fields)


class FakeClient:
    """The ControlClient surface the roles use: report answers with queued decisions."""

    def __init__(self) -> None:
        self.answers: list[list[Decision]] = []
        self.reports: list[Any] = []
        self.in_fallback = False
        self.fallback_steps = 0
        self.can_poll = True

    def report(self, report: Any) -> list[Decision]:
        self.reports.append(report)
        return self.answers.pop(0) if self.answers else []

    def poll(self) -> list[Decision]:
        return []


def req(rid: str, finished: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        rid=rid,
        finished=lambda: finished,
        origin_input_ids=[1, 2, 3],
        output_ids=[4],
        sampling_params=SimpleNamespace(max_new_tokens=8, custom_params=None),
    )


def scheduler(*queued: str) -> SimpleNamespace:
    return SimpleNamespace(
        waiting_queue=[req(r) for r in queued],
        running_batch=SimpleNamespace(reqs=[]),
        chunked_req=None,
        token_to_kv_pool_allocator=SimpleNamespace(available_size=lambda: 10),
    )


def reporter(client: FakeClient, inbox: DecisionInbox, sched: Any, interval: int = 4, quiet: int | None = None,
             installer: PlacementInstaller | None = None) -> StepReporter:
    return StepReporter(
        scheduler=sched, client=client, inbox=inbox, pauser=PauseManager(),
        installer=installer or PlacementInstaller(None, LAYERS), pool=None, layers=LAYERS, page_size=1,
        report_interval=interval, quiet_interval=quiet,
    )


def test_inbox_keeps_the_newest_expiry_and_hands_decisions_over_once() -> None:
    """receive() tracks the newest decision's expiry; take() empties the inbox."""
    inbox = DecisionInbox()
    inbox.receive([decision(5), decision(9)])
    inbox.receive([])
    assert inbox.expiry_step == 9
    assert [d.expiry_step for d in inbox.take()] == [5, 9]
    assert inbox.take() == [] and inbox.expiry_step == 9


def test_boundary_composes_received_decisions_into_one_install() -> None:
    """Admissions and prefill layers merge, a later resume cancels a pause, the newest
    placements win, the install is for the next step, an unapplied pause is deferred."""
    inbox = DecisionInbox()
    inbox.receive([
        decision(10, pause=("a", "b"), admit=("q1",), min_gpu_layers={"q1": 1}, reason="batch-change",
                  placements={"a": (1, 0)}),
        decision(12, resume=("b",), admit=("q2",), reason="expiry", placements={"c": (1, 1)}),
    ])
    boundary = StepBoundary(
        tp=TpSync(0, 1), installer=PlacementInstaller(None, LAYERS), pauser=PauseManager(),
        admission=AdmissionGate(enabled=True), inbox=inbox, client=FakeClient(), pages_of=lambda r: (),
    )
    install = boundary.compose(step=3)
    assert install.step == 4
    assert install.pause == ("a",) and install.resume == ()  # b is not parked: nothing to resume
    assert install.admit == ("q1", "q2") and install.prefill_layers == {"q1": 1}
    assert install.placements == {"c": (1, 1)} and install.reason == "batch-change,expiry"
    assert inbox.deferred_pause == {"a": 3} and inbox.pending == []


def test_quiet_boundary_installs_nothing_and_records_it() -> None:
    """One rank, nothing received, nobody paused: the running batch is returned untouched."""
    boundary = StepBoundary(
        tp=TpSync(0, 1), installer=PlacementInstaller(None, LAYERS), pauser=PauseManager(),
        admission=AdmissionGate(enabled=False), inbox=DecisionInbox(), client=FakeClient(), pages_of=lambda r: (),
    )
    batch = object()
    assert boundary.apply(batch, None, step=0) is batch
    assert boundary.take_record() == {
        "admitted_now": [], "paused_now": [], "resumed_now": [], "pauses_skipped": {}, "decision": None,
        "fallback": False,
    }
    assert boundary.take_record() == {}


def test_steady_decode_steps_are_coalesced_up_to_the_interval() -> None:
    """The same requests decoding, nothing queued or finished: one report per interval steps,
    carrying the mean decode step time; a finished request is reported at once."""
    client, inbox = FakeClient(), DecisionInbox()
    client.answers = [[decision(100)]]
    rep = reporter(client, inbox, scheduler(), interval=3)
    batch = SimpleNamespace(reqs=[req("a"), req("b")])
    sent = []
    for step, ms in enumerate((10.0, 20.0, 30.0, 40.0, 50.0), start=1):
        inbox.take()  # the boundary installs what came back
        _, was_sent = rep.end_step(batch, step=step, finished=(), is_decode=True, step_ms=ms, layer_ms=None,
                                   build_always=False)
        sent.append(was_sent)
    assert sent == [True, False, False, True, False]
    assert [r.observed_step_ms for r in client.reports] == [10.0, 30.0]  # mean of 20, 30, 40
    report, was_sent = rep.end_step(SimpleNamespace(reqs=[req("a"), req("b", finished=True)]), step=6,
                                    finished=("b",), is_decode=True, step_ms=60.0, layer_ms=None, build_always=False)
    assert was_sent and report is not None and report.finished == ("b",)
    assert rep.reports == 3


def test_queued_requests_are_reported_with_their_first_seen_time() -> None:
    """A queued request is never coalesced away and keeps its first-seen arrival time."""
    client, inbox = FakeClient(), DecisionInbox()
    rep = reporter(client, inbox, scheduler("q"))
    batch = SimpleNamespace(reqs=[req("a")])
    first, _ = rep.end_step(batch, step=1, finished=(), is_decode=True, step_ms=1.0, layer_ms=None, build_always=False)
    second, sent = rep.end_step(batch, step=2, finished=(), is_decode=True, step_ms=1.0, layer_ms=None,
                                build_always=False)
    assert sent and first is not None and second is not None
    assert first.queued[0].arrival_ms == second.queued[0].arrival_ms
    assert second.free_gpu_blocks == 10 * LAYERS


def test_report_reads_each_requests_fixed_fields_once_and_follows_a_reused_rid() -> None:
    """A report's per-request state: context and generated tokens read every report; the prompt
    length, max_new_tokens and the request's own SLO read once per request object -- a new
    request under a finished one's rid is read afresh, and entries of requests gone are dropped."""
    client, inbox = FakeClient(), DecisionInbox()
    rep = reporter(client, inbox, scheduler(), interval=1)
    a, b = req("a"), req("b")
    batch = SimpleNamespace(reqs=[a, b])
    rep.end_step(batch, step=1, finished=(), is_decode=True, step_ms=1.0, layer_ms=None, build_always=False)
    a.output_ids.append(5)
    a.sampling_params.max_new_tokens = 99  # never changes in SGLang: shows the value is kept
    rep.end_step(batch, step=2, finished=(), is_decode=True, step_ms=1.0, layer_ms=None, build_always=False)
    first, second = client.reports
    assert [(r.id, r.context_tokens, r.generated_tokens, r.max_new_tokens) for r in first.running] == [
        ("a", 4, 1, 8), ("b", 4, 1, 8)]
    assert [(r.id, r.context_tokens, r.generated_tokens, r.max_new_tokens) for r in second.running] == [
        ("a", 5, 2, 8), ("b", 4, 1, 8)]
    # "b" finishes; a new request reuses the rid "a" with another prompt, limit and SLO
    again = req("a")
    again.origin_input_ids = [1] * 10
    again.sampling_params = SimpleNamespace(max_new_tokens=3, custom_params={"kvplane_slo_tbt_ms": 40.0})
    rep.end_step(SimpleNamespace(reqs=[again]), step=3, finished=("a", "b"), is_decode=True, step_ms=1.0,
                 layer_ms=None, build_always=False)
    third = client.reports[-1]
    assert [(r.id, r.context_tokens, r.max_new_tokens, r.slo_tbt_ms) for r in third.running] == [
        ("a", 11, 3, 40.0)]
    assert list(rep._fixed) == ["a"] and rep._fixed["a"][0] is again  # "b" forgotten


def test_stats_line_holds_the_step_and_the_boundary_record(tmp_path: Path) -> None:
    """One JSON line per step with the report's requests and what the boundary did."""
    client, inbox = FakeClient(), DecisionInbox()
    rep = reporter(client, inbox, scheduler())
    report, _ = rep.end_step(SimpleNamespace(reqs=[req("a")]), step=1, finished=(), is_decode=False, step_ms=2.5,
                             layer_ms=(1.0, 1.5), build_always=True)
    writer = StepStatsWriter(tmp_path / "stats.jsonl")
    writer.write_step(
        step=1, report=report, step_ms=2.5, is_decode=False, reported=True, layers=LAYERS, pool_stats=None,
        boundary={"admitted_now": ["a"], "fallback": False}, admission=AdmissionGate(enabled=True),
        installer=PlacementInstaller(None, LAYERS), client=client,
    )
    writer.close()
    [line] = (tmp_path / "stats.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert record["step"] == 1 and record["mode"] == "extend" and record["running"] == ["a"]
    assert record["admitted_now"] == ["a"] and "fallback_steps" in record and record["fallback"] is False
    assert record["layer_compute_ms"] == [1.0, 1.5] and record["pool"] is None
    assert stats_dict(SimpleNamespace(x=1)) is None


def test_reports_carry_the_h2d_bandwidth_the_copies_achieved_since_the_last_report() -> None:
    """The data plane's account (bytes booked with their seconds) since the last report, in GB/s;
    no sample under MIN_H2D_SAMPLE_BYTES (a few small copies time their launch), none without the
    layered pool, and what was sampled once is not sampled again."""
    from sglang_ext.dataplane.transfer_times import TransferTimes
    from sglang_ext.step_reporter import MIN_H2D_SAMPLE_BYTES

    times = TransferTimes()
    client, inbox = FakeClient(), DecisionInbox()
    rep = StepReporter(
        scheduler=scheduler(), client=client, inbox=inbox, pauser=PauseManager(),
        installer=PlacementInstaller(None, LAYERS), pool=SimpleNamespace(core=SimpleNamespace(link_account=times)),
        layers=LAYERS, page_size=1, report_interval=1,
    )
    batch = SimpleNamespace(reqs=[req("a")])

    def send(step: int) -> float | None:
        report, sent = rep.end_step(batch, step=step, finished=(), is_decode=True, step_ms=1.0, layer_ms=None,
                                    build_always=False)
        assert sent and report is not None
        return report.h2d_gbps

    times.add_copy("h2d", 0.004, 200_000_000)  # 200 MB in 4 ms
    assert send(1) == 50.0
    assert send(2) is None  # nothing new
    times.add_copy("h2d", 0.0002, 50_000_000)
    assert send(3) is None  # enough bytes in too short a time (one short copy): kept for the next
    times.add_copy("d2h", 0.010, 500_000_000)  # the other direction is not the H2D link
    times.add_copy("h2d", 0.002, 20_000_000)
    assert send(4) == pytest.approx(70_000_000 / 0.0022 / 1e9)
    assert [r.h2d_gbps for r in client.reports][:3] == [50.0, None, None]
    times.add_copy("h2d", 0.005, MIN_H2D_SAMPLE_BYTES - 1)
    assert send(5) is None  # too few bytes to say anything about the link
    plain = reporter(FakeClient(), DecisionInbox(), scheduler(), interval=1)  # pool=None: not layered
    report, _ = plain.end_step(batch, step=1, finished=(), is_decode=True, step_ms=1.0, layer_ms=None,
                               build_always=False)
    assert report is not None and report.h2d_gbps is None


def test_the_bandwidth_sample_floors_apply_to_what_was_measured() -> None:
    """Under sampled timing (``--kv-timing-interval``) a timed copy counts N times in the totals;
    the sample's floors and its GB/s read the unweighted measured figures: a quarter of the byte
    floor measured in one sampled step (weight 8: twice the floor in the totals) is no sample,
    and the GB/s of a sample is the measured one (negative control of the floor: the weighted
    bytes pass it)."""
    from sglang_ext.dataplane.transfer_times import TransferTimes
    from sglang_ext.step_reporter import MIN_H2D_SAMPLE_BYTES

    times = TransferTimes()
    client = FakeClient()
    rep = StepReporter(
        scheduler=scheduler(), client=client, inbox=DecisionInbox(), pauser=PauseManager(),
        installer=PlacementInstaller(None, LAYERS), pool=SimpleNamespace(core=SimpleNamespace(link_account=times)),
        layers=LAYERS, page_size=1, report_interval=1,
    )

    def send(step: int) -> float | None:
        report, _ = rep.end_step(SimpleNamespace(reqs=[req("a")]), step=step, finished=(), is_decode=True,
                                 step_ms=1.0, layer_ms=None, build_always=False)
        assert report is not None
        return report.h2d_gbps

    times.add_copy("h2d", 0.002, MIN_H2D_SAMPLE_BYTES // 4, weight=8)
    assert times.h2d_bytes >= MIN_H2D_SAMPLE_BYTES and times.h2d_timed_bytes < MIN_H2D_SAMPLE_BYTES
    assert send(1) is None
    times.add_copy("h2d", 0.003, 3 * MIN_H2D_SAMPLE_BYTES // 4, weight=3)  # another weight and speed
    measured = MIN_H2D_SAMPLE_BYTES / 0.005 / 1e9
    assert send(2) == pytest.approx(measured)
    assert times.h2d_bytes / times.h2d_s / 1e9 != pytest.approx(measured)  # the estimates' ratio differs


def test_the_bandwidth_sample_reads_the_served_cores_account(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wired to a real served core (what ``get_kvcache().core`` is in SGLang) after staged steps:
    the sample is the core's timed H2D bytes over their seconds."""
    from sglang_ext import step_reporter
    from tests.dataplane.core_driver import offloaded_driver

    monkeypatch.setattr(step_reporter, "MIN_H2D_SAMPLE_BYTES", 1)  # toy shapes move a few KiB
    monkeypatch.setattr(step_reporter, "MIN_H2D_SAMPLE_SECONDS", 0.0)
    d = offloaded_driver()
    for _ in range(3):
        assert d.step([("a", 1), ("b", 1)])
    times = d.core.transfer_times
    assert d.core.link_account is None  # the CPU engine's copies are inside the layers: no sample
    d.core.store.engine.copies_beside_compute = True  # as the CUDA engine's
    client = FakeClient()
    rep = StepReporter(
        scheduler=scheduler(), client=client, inbox=DecisionInbox(), pauser=PauseManager(),
        installer=PlacementInstaller(None, LAYERS), pool=SimpleNamespace(core=d.core), layers=LAYERS,
        page_size=1, report_interval=1,
    )
    report, sent = rep.end_step(SimpleNamespace(reqs=[req("a")]), step=1, finished=(), is_decode=True, step_ms=1.0,
                                layer_ms=None, build_always=False)
    assert sent and report is not None and times.h2d_bytes > 0
    assert report.h2d_gbps == pytest.approx(times.h2d_timed_bytes / times.h2d_timed_s / 1e9)
    assert times.h2d_timed_bytes == times.h2d_bytes  # the CPU engine times every copy (weight 1)


def _cadence(rep: StepReporter, inbox: DecisionInbox, times: list[float], start: int = 1,
             answers: dict[int, list[Decision]] | None = None) -> list[int]:
    """Steady decode steps of requests a and b taking ``times`` ms; the steps reported. The
    boundary installs what came back; ``answers[step]`` arrive with that step's report."""
    client = rep.client
    batch = SimpleNamespace(reqs=[req("a"), req("b")])
    sent = []
    for step, ms in enumerate(times, start=start):
        inbox.take()
        client.answers = [(answers or {}).get(step, [])]
        _, was_sent = rep.end_step(batch, step=step, finished=(), is_decode=True, step_ms=ms, layer_ms=None,
                                   build_always=False)
        if was_sent:
            sent.append(step)
    return sent


def test_a_quiet_stretch_is_reported_at_the_quiet_interval() -> None:
    """Nothing offloaded and the step time steady for QUIET_AFTER reports: the stretch waits up to
    the quiet interval; without a quiet interval (the negative control) the base one holds."""
    inbox = DecisionInbox()
    inbox.receive([decision(1000)])
    quiet = reporter(FakeClient(), inbox, scheduler(), interval=2, quiet=8)
    # reports at 1 (first), 3, 5 (two steady reports in a row), then quiet: 13, 21
    assert _cadence(quiet, inbox, [10.0] * 24) == [1, 3, 5, 13, 21]
    assert [r.observed_step_ms for r in quiet.client.reports][-1] == 10.0  # the stretch's mean
    inbox = DecisionInbox()
    inbox.receive([decision(1000)])
    base = reporter(FakeClient(), inbox, scheduler(), interval=2)
    assert _cadence(base, inbox, [10.0] * 24) == list(range(1, 24, 2))


def test_a_drifting_step_time_goes_back_to_the_base_interval() -> None:
    """A stretch whose mean step moves more than QUIET_DRIFT from the last report's is reported
    once the base interval has passed; a small wobble stays quiet; steadiness is earned again."""
    from sglang_ext.step_reporter import QUIET_DRIFT

    inbox = DecisionInbox()
    inbox.receive([decision(1000)])
    rep = reporter(FakeClient(), inbox, scheduler(), interval=2, quiet=8)
    wobble = 10.0 * (1 + QUIET_DRIFT * 0.9)
    times = [10.0] * 6 + [wobble, 10.0] * 2 + [13.0] * 14
    # quiet from 5; steps 6-10 wobble within the drift. The drift is judged on the last
    # `interval` steps, so the first 13 ms step (11: 11.5 ms against 10) is reported at once,
    # although the stretch's mean (10.8 ms) has not drifted; 13 (13 ms against 10.8) is not
    # steady, 15 and 17 are, so the next report would be at 25
    assert _cadence(rep, inbox, times) == [1, 3, 5, 11, 13, 15, 17]
    assert [round(r.observed_step_ms, 2) for r in rep.client.reports][3:5] == [10.8, 13.0]


def test_offloading_a_decision_or_a_request_off_the_gpu_ends_the_quiet_cadence() -> None:
    """A decision that puts a layer on host (received with a report) ends quiet until reports
    show every request on the GPU again; a request with a host layer keeps the base interval."""
    inbox = DecisionInbox()
    inbox.receive([decision(1000)])
    rep = reporter(FakeClient(), inbox, scheduler(), interval=2, quiet=8)
    offload = decision(1000, placements={"a": (1, 0), "b": (1, 1)})
    assert inbox.received_offloading == 0
    assert _cadence(rep, inbox, [10.0] * 16, answers={5: [offload]}) == [1, 3, 5, 7, 15]
    assert inbox.received_offloading == 1
    identity = decision(1000, placements={"a": (1, 1), "b": (1, 1)})
    inbox.receive([identity])  # an all-GPU decision does not
    assert inbox.received_offloading == 1
    installer = PlacementInstaller(SimpleNamespace(update_residency=lambda wants: None), LAYERS)
    installer.placements.update({"a": (1, 0), "b": (1, 1)})
    inbox = DecisionInbox()
    inbox.receive([decision(1000)])
    placed = reporter(FakeClient(), inbox, scheduler(), interval=2, quiet=8, installer=installer)
    assert _cadence(placed, inbox, [10.0] * 16) == list(range(1, 16, 2))
    assert placed.client.reports[-1].running[0].gpu_layers == 1


def test_an_expiry_is_reported_once() -> None:
    """The step at the installed plan's expiry is reported; the steps after it wait as usual
    until the next decision, whose own expiry is reported again."""
    inbox = DecisionInbox()
    inbox.receive([decision(4)])
    rep = reporter(FakeClient(), inbox, scheduler(), interval=100)
    assert _cadence(rep, inbox, [10.0] * 8) == [1, 4]
    inbox.receive([decision(9)])
    assert _cadence(rep, inbox, [10.0] * 4, start=9) == [9]


def test_the_decode_step_after_a_prefill_or_a_finish_is_no_batch_change() -> None:
    """A prefill's report names the running batch and the new requests; a finish's names those
    left. The next decode step of exactly those requests is steady (coalesced); a request the
    last report did not name is reported at once."""
    client, inbox = FakeClient(), DecisionInbox()
    inbox.receive([decision(100)])
    inbox.take()  # installed
    sched = scheduler()
    a, b, c = req("a"), req("b"), req("c")
    sched.running_batch = SimpleNamespace(reqs=[a])
    rep = reporter(client, inbox, sched, interval=8)

    def end(batch_reqs: list[Any], step: int, decode: bool = True, finished: tuple[str, ...] = ()) -> bool:
        return rep.end_step(SimpleNamespace(reqs=batch_reqs), step=step, finished=finished, is_decode=decode,
                            step_ms=1.0, layer_ms=None, build_always=False)[1]

    assert end([b], 1, decode=False)  # prefill of b beside the running a
    assert [r.id for r in client.reports[-1].running] == ["a", "b"]
    merged = [a, b]
    sched.running_batch = SimpleNamespace(reqs=merged)
    assert not end(merged, 2)  # the merged decode batch: the requests the report named
    b.finished = lambda: True
    assert end(merged, 3, finished=("b",))
    sched.running_batch = SimpleNamespace(reqs=[a])
    assert not end([a], 4)  # b filtered out: the requests the finish's report named
    sched.running_batch = SimpleNamespace(reqs=[a, c])
    assert end([a, c], 5)  # c was never reported


class _Pauser:
    """The PauseManager surface the reporter reads: parked requests (no pause dropped)."""

    has_unreported_drops = False

    def __init__(self, *parked: Any) -> None:
        self.held = list(parked)

    def __len__(self) -> int:
        return len(self.held)

    def __contains__(self, rid: str) -> bool:
        return any(r.rid == rid for r in self.held)

    def parked(self) -> list[Any]:
        return [SimpleNamespace(req=r) for r in self.held]


def test_a_resume_is_reported_the_step_it_runs() -> None:
    """A report while b is parked names b as paused; once b is resumed (the pauser empty again)
    the step that runs a and b is a batch change, reported at once."""
    client, inbox = FakeClient(), DecisionInbox()
    inbox.receive([decision(100)])
    inbox.take()
    a, b = req("a"), req("b")
    sched = scheduler()
    sched.running_batch = SimpleNamespace(reqs=[a])
    pauser = _Pauser(b)
    rep = StepReporter(scheduler=sched, client=client, inbox=inbox, pauser=pauser,  # type: ignore[arg-type]
                       installer=PlacementInstaller(None, LAYERS), pool=None, layers=LAYERS, page_size=1,
                       report_interval=8)

    def end(batch_reqs: list[Any], step: int) -> bool:
        return rep.end_step(SimpleNamespace(reqs=batch_reqs), step=step, finished=(), is_decode=True,
                            step_ms=1.0, layer_ms=None, build_always=False)[1]

    assert end([a], 1)  # someone is parked: reported
    assert [(r.id, r.paused) for r in client.reports[-1].running] == [("a", False), ("b", True)]
    pauser.held.clear()  # resumed at the boundary: merged back behind a
    sched.running_batch = SimpleNamespace(reqs=[a, b])
    assert end([a, b], 2)
    assert not end([a, b], 3)


def test_an_expiry_is_reported_to_every_step_without_poll_or_when_a_stale_plan_expired() -> None:
    """After the expiry report, steps wait only when the next decision can come by poll; a
    decision whose own expiry has passed (planned before the report) is reported at once."""
    inbox = DecisionInbox()
    inbox.receive([decision(4)])
    rep = reporter(FakeClient(), inbox, scheduler(), interval=100)
    rep.client.can_poll = False  # a control plane that answers reports only
    assert _cadence(rep, inbox, [10.0] * 6) == [1, 4, 5, 6]
    inbox = DecisionInbox()
    inbox.receive([decision(4)])
    rep = reporter(FakeClient(), inbox, scheduler(), interval=100)
    assert _cadence(rep, inbox, [10.0] * 5) == [1, 4]
    inbox.receive([decision(3)])  # planned from a report before step 3, delivered by poll now
    assert _cadence(rep, inbox, [10.0] * 3, start=6) == [6]


def test_a_recomputing_request_is_never_quiet() -> None:
    """A request with an uncached prefix (eLLM recompute) keeps the base interval even when its
    prefix was set after the last report."""
    inbox = DecisionInbox()
    inbox.receive([decision(1000)])
    installer = PlacementInstaller(None, LAYERS)
    rep = reporter(FakeClient(), inbox, scheduler(), interval=2, quiet=8, installer=installer)
    assert _cadence(rep, inbox, [10.0] * 6) == [1, 3, 5]
    installer.set_uncached("a", 2)
    assert _cadence(rep, inbox, [10.0] * 6, start=7) == [7, 9, 11]
    installer.set_uncached("a", 0)
    assert _cadence(rep, inbox, [10.0] * 9, start=13) == [13, 21]
