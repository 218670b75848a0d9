"""PauseManager leaves a request running when its last output token (``max_new_tokens``) comes in
the next step, or under SGLang's overlap loop in the step in flight at the boundary: it frees its
KV when it finishes, so parking it would only write its KV back for one token later."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from sglang_ext.pause import PauseManager
from tests.sglang.test_pause_drop_finished import _Batch


@dataclass
class _Req:
    rid: str
    outputs: int
    max_new: int | None
    done: bool = False
    to_finish: object = None
    output_ids: list[int] = field(init=False)
    sampling_params: SimpleNamespace = field(init=False)

    def __post_init__(self) -> None:
        self.output_ids = [0] * self.outputs
        self.sampling_params = SimpleNamespace(max_new_tokens=self.max_new)

    def finished(self) -> bool:
        return self.done


def _pause(in_flight: int, reqs: list[_Req]) -> tuple[list[str], PauseManager]:
    pauser = PauseManager(in_flight_steps=in_flight)
    return pauser.pause(_Batch(list(reqs)), [r.rid for r in reqs], step=3), pauser


def test_without_overlap_only_the_request_whose_next_token_is_its_last_keeps_running():
    reqs = [_Req("last", 11, 12), _Req("two_left", 10, 12), _Req("open", 3, None)]
    paused, pauser = _pause(0, reqs)
    assert paused == ["two_left", "open"]
    assert pauser.skipped == {"finishing": 1}


def test_under_overlap_the_step_in_flight_counts_too():
    reqs = [_Req("last", 11, 12), _Req("two_left", 10, 12), _Req("three_left", 9, 12)]
    paused, pauser = _pause(1, reqs)
    assert paused == ["three_left"]  # two_left's last token comes in the step after the one in flight
    assert pauser.skipped == {"finishing": 2}
    assert "two_left" not in pauser and "three_left" in pauser


def test_the_boundary_records_the_skip_and_keeps_the_pause_deferred():
    """A plan pausing a finishing request and an open one: the open one is parked, the skip is on
    the boundary's record by reason, and the finishing one's pause stays deferred (retried at the
    next boundary, dropped once the request is gone)."""
    from controlplane.api import Decision
    from controlplane.model import Plan
    from sglang_ext.admission import AdmissionGate
    from sglang_ext.decision_inbox import DecisionInbox
    from sglang_ext.step_boundary import StepBoundary
    from sglang_ext.tp_sync import PlacementInstaller, TpSync
    from tests.sglang.test_scheduler_roles import FakeClient

    inbox = DecisionInbox()
    plan = Plan(True, (), {}, 1.0, 8, 0, 0, "test", 0.0)
    inbox.receive([Decision(plan=plan, apply_at_step=0, expiry_step=10, pause=("a", "b"))])
    pauser = PauseManager()
    boundary = StepBoundary(
        tp=TpSync(0, 1), installer=PlacementInstaller(None, 2), pauser=pauser, admission=AdmissionGate(enabled=False),
        inbox=inbox, client=FakeClient(), pages_of=lambda r: (),
    )
    running = _Batch([_Req("a", 7, 8), _Req("b", 1, 8), _Req("e", 1, 8)])  # e keeps the batch going
    boundary.apply(running, None, step=4)
    record = boundary.take_record()
    assert record["paused_now"] == ["b"] and record["pauses_skipped"] == {"finishing": 1}
    assert [r.rid for r in running.reqs] == ["a", "e"] and "a" in inbox.deferred_pause
    running.reqs = [_Req("c", 0, 8)]  # "a" finished and left: its deferred pause is dropped
    boundary.apply(running, None, step=5)
    assert "a" not in inbox.deferred_pause and boundary.take_record()["pauses_skipped"] == {}


def test_a_pause_a_batch_feature_refuses_is_dropped_not_deferred():
    """A batch with a custom logit processor cannot be split: the pause is dropped at that
    boundary (the control plane's pause lapses a step after its due step and it plans the
    request running); deferred, it was applied steps later, once the batch could split, pausing
    a request the control plane planned running (control-plane review, session 78). Control: a
    finishing request's pause stays deferred."""
    from controlplane.api import Decision
    from controlplane.model import Plan
    from sglang_ext.admission import AdmissionGate
    from sglang_ext.decision_inbox import DecisionInbox
    from sglang_ext.step_boundary import StepBoundary
    from sglang_ext.tp_sync import PlacementInstaller, TpSync
    from tests.sglang.test_scheduler_roles import FakeClient

    def boundary_after(custom: bool, req: _Req) -> DecisionInbox:
        inbox = DecisionInbox()
        plan = Plan(True, (), {}, 1.0, 8, 0, 0, "test", 0.0)
        inbox.receive([Decision(plan=plan, apply_at_step=0, expiry_step=10, pause=(req.rid,))])
        boundary = StepBoundary(
            tp=TpSync(0, 1), installer=PlacementInstaller(None, 2), pauser=PauseManager(),
            admission=AdmissionGate(enabled=False), inbox=inbox, client=FakeClient(), pages_of=lambda r: (),
        )
        running = _Batch([req, _Req("e", 1, 8)])
        running.sampling_info = SimpleNamespace(penalizer_orchestrator=None, has_custom_logit_processor=custom)
        boundary.apply(running, None, step=4)
        assert [r.rid for r in running.reqs] == [req.rid, "e"]  # not paused either way
        return inbox

    assert "a" not in boundary_after(True, _Req("a", 1, 8)).deferred_pause
    assert "f" in boundary_after(False, _Req("f", 7, 8)).deferred_pause  # finishing: deferred


def test_a_batch_feature_skip_counts_only_decoding_requests_and_warns_once_per_request():
    """A batch that cannot be split (a custom logit processor): the pauses of its decoding requests
    are counted at every retry, an unknown id is not counted, and each request is logged once."""
    from structlog.testing import capture_logs

    pauser = PauseManager()
    batch = _Batch([_Req("a", 1, 8), _Req("b", 1, 8)])
    batch.sampling_info = SimpleNamespace(penalizer_orchestrator=None, has_custom_logit_processor=True)
    with capture_logs() as logs:
        assert pauser.pause(batch, ["a", "unknown"], step=1) == []
        assert pauser.pause(batch, ["a", "b"], step=2) == []  # retried: a again, b new
    assert pauser.skipped == {"custom_logit_processor": 3}
    assert [e["rids"] for e in logs if e["event"] == "pause_skipped"] == [["a"], ["b"]]
    assert [r.rid for r in batch.reqs] == ["a", "b"]


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 0.5}, {"presence_penalty": -0.2},
                                     {"repetition_penalty": 1.1}])
def test_under_overlap_a_request_with_a_token_counting_penalty_is_not_paused(penalty):
    """Under the overlap loop a parked row's penalty counts drift (a token missed, another counted
    twice at the resume: SGLang counts the token of the step before the one in flight), so such
    a request is not paused: skipped as penalties_in_flight and dropped by the boundary. Controls:
    the same request pauses without the overlap loop, and a request without those penalties (or
    with min_new_tokens only) pauses under it."""
    pen, plain = _Req("pen", 3, None), _Req("plain", 3, None)
    pen.sampling_params = SimpleNamespace(max_new_tokens=None, min_new_tokens=0, **penalty)
    plain.sampling_params = SimpleNamespace(max_new_tokens=None, min_new_tokens=2, frequency_penalty=0.0,
                                            presence_penalty=0.0, repetition_penalty=1.0)
    paused, pauser = _pause(1, [pen, plain])
    assert paused == ["plain"]
    assert pauser.skipped == {"penalties_in_flight": 1} and pauser.last_dropped == ["pen"]
    pen2, plain2 = _Req("pen", 3, None), _Req("plain", 3, None)
    pen2.sampling_params, plain2.sampling_params = pen.sampling_params, plain.sampling_params
    assert _pause(0, [pen2, plain2])[0] == ["pen", "plain"]

