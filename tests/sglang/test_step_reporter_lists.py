"""What the step reporter tells the control plane about requests SGLang moved between its lists
(scheduler review, session 63)."""

from __future__ import annotations

from types import SimpleNamespace

from sglang_ext.decision_inbox import DecisionInbox
from tests.sglang.test_scheduler_roles import FakeClient, reporter, req, scheduler


def test_a_request_retracted_since_its_batch_ran_is_reported_queued_not_running() -> None:
    """SGLang's retraction moves a request from the running batch back to the queue after the
    batch that ran it: the report names it queued only (the control plane refuses an id that is
    both, ``report_validation``). Negative control, by hand: without the waiting check it was
    in both lists."""
    client, inbox = FakeClient(), DecisionInbox()
    sched = scheduler("b")
    rep = reporter(client, inbox, sched)
    batch = SimpleNamespace(reqs=[req("a"), req("b")])  # b ran in this batch, then was retracted
    report, _ = rep.end_step(batch, step=1, finished=(), is_decode=True, step_ms=1.0, layer_ms=None,
                             build_always=True)
    assert report is not None
    assert [r.id for r in report.running] == ["a"] and [q.id for q in report.queued] == ["b"]
