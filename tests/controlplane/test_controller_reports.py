"""Step reports the controller refuses or discounts: fields past the model, an id both queued and
running (control-plane review, session 63), and a step that finished a request, which is no
evidence for the placement model."""

from __future__ import annotations

import pytest

from controlplane.api import InvalidArgument, QueuedRequest, RequestState, StepReport
from tests.controlplane.test_controller import make
from tests.controlplane.test_controller_harness import PROFILE


def test_a_report_past_the_model_or_naming_a_request_twice_is_rejected() -> None:
    """A paused request's ``gpu_layers`` above the model's layers inflated the memory the
    schedulers could free (a queued request was admitted with layers that do not exist), and a
    queued id also running was admitted while it ran: both are InvalidArgument naming the field,
    and the session's state is untouched (the next valid report is served). Controls: the
    model's layer count, and distinct ids, are accepted."""
    session, w, _ = make()
    layers = len(PROFILE.layer_compute_ms)
    w.add("a", 100)
    w.report()
    step, now = w.step + 1, w.now_ms + 1
    over = RequestState("a", 110, 10, None, True, layers + 1)
    with pytest.raises(InvalidArgument, match=rf"running\[0\]\.gpu_layers: {layers + 1} is out of range"):
        session.report(StepReport(step=step, now_ms=now, running=(over,)))
    with pytest.raises(InvalidArgument, match=r"queued\[1\]\.id: 'a' is also running"):
        session.report(StepReport(step=step, now_ms=now, running=(RequestState("a", 110, 10),),
                                  queued=(QueuedRequest("q", 10, now), QueuedRequest("a", 10, now))))
    session.report(StepReport(step=step, now_ms=now, running=(RequestState("a", 110, 10, None, True, layers),),
                              queued=(QueuedRequest("q", 10, now),)))


def test_a_step_that_finished_a_request_does_not_move_the_profile() -> None:
    """Report 1 lists X in ``finished``: the step it times still read X's KV (fetched: X is
    offloaded), but the tracker has dropped X, so a prediction for A alone saw a mismatch and
    moved the profile away from a true observation. Now such a step is no evidence. Control:
    the same true observation with X still running leaves the profile too; negative control, by
    hand: without the check the finishing case moved comp[0] 0.5 -> 0.599."""
    from controlplane import api
    from controlplane.controller.profile_tracker import ProfileTracker
    from controlplane.embedded import EmbeddedControlPlane
    from controlplane.model import Hardware, ModelSpec, Profile

    for finished in (False, True):
        layers, bs = 8, 16
        info = api.WorkerInfo("w", ModelSpec(layers, bs, 65536), Hardware(600, 25.0), Profile((0.5,) * layers))
        session = EmbeddedControlPlane(synchronous=True).open_session(info)
        ctx = {"A": 400, "X": 2000}
        (d,) = session.report(StepReport(step=0, now_ms=0.0, running=tuple(
            RequestState(r, c, slo_tbt_ms=200.0) for r, c in ctx.items())))
        rows = [d.plan.placements[r] for r in ("A", "X")]
        assert 0 in rows[1]  # X has offloaded layers: its KV is fetched every step
        truth = ProfileTracker(info.profile, 25.0, 65536, bs).predict_step_ms(
            rows, [-(-(ctx[r] + 1) // bs) for r in ("A", "X")])
        running = (RequestState("A", 401, 1, slo_tbt_ms=200.0),)
        if not finished:
            running += (RequestState("X", 2001, 1, slo_tbt_ms=200.0),)
        session.report(StepReport(step=1, now_ms=20.0, running=running, observed_step_ms=truth,
                                  finished=("X",) if finished else ()))
        status = session.status()
        assert status.layer_compute_ms[0] == 0.5 and status.h2d_gbps == 25.0, finished
        assert "profile-mismatch" not in status.last_triggers


@pytest.mark.parametrize(("field", "value", "message"), [
    ("observed_step_ms", float("inf"), r"observed_step_ms: inf is out of range \(allowed finite >= 0\)"),
    ("observed_step_ms", float("nan"), r"observed_step_ms: nan is out of range"),
    ("h2d_gbps", float("inf"), r"h2d_gbps: inf is out of range \(allowed finite > 0\)"),
    ("layer_compute_ms", "inf", r"layer_compute_ms\[1\]: inf is out of range \(allowed finite >= 0\)"),
    ("layer_compute_ms", "nan", r"layer_compute_ms\[1\]: nan is out of range"),
    ("layer_compute_ms", "-1", r"layer_compute_ms\[1\]: -1.0 is out of range"),
    ("slo_tbt_ms", float("inf"), r"running\[0\]\.slo_tbt_ms: inf is out of range \(allowed finite > 0\)"),
])
def test_non_finite_telemetry_is_refused_and_changes_nothing(field: str, value: object, message: str) -> None:
    """Scenario (control-plane review, session 77): the gRPC converter refuses non-finite numbers,
    but the embedded plane and the simulator hand reports over as they are. ``h2d_gbps`` or
    ``observed_step_ms`` inf made every later report fail; a layer sample of inf, NaN or below 0
    poisoned the profile for good; a running request's ``slo_tbt_ms`` inf raised ValueError
    half-way through, after its deposit moved. Each is InvalidArgument naming the field, and
    the next valid report is served on an unchanged profile. Control: finite values pass."""
    session, w, _ = make()
    layers = len(PROFILE.layer_compute_ms)
    w.add("a", 100)
    w.report()
    before = session.status()
    step, now = w.step + 1, w.now_ms + 1
    good = {"observed_step_ms": 5.0, "h2d_gbps": 10.0, "layer_compute_ms": (1.0,) * layers}
    if field == "layer_compute_ms":
        bad = {field: (1.0, float(value), *(1.0,) * (layers - 2))}  # type: ignore[arg-type]
    elif field == "slo_tbt_ms":
        bad = {}
    else:
        bad = {field: value}
    slo = value if field == "slo_tbt_ms" else None
    running = (RequestState("a", 110, 10, slo),)
    with pytest.raises(InvalidArgument, match=message):
        session.report(StepReport(step=step, now_ms=now, running=running, **{**good, **bad}))
    assert session.status() == before
    session.report(StepReport(step=step, now_ms=now, running=(RequestState("a", 110, 10),), **good))
