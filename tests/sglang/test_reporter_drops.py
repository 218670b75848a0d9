"""The step reporter names the pauses the data plane dropped (``StepReport.pauses_dropped``)."""

from __future__ import annotations

from types import SimpleNamespace

from sglang_ext.decision_inbox import DecisionInbox
from tests.sglang.test_scheduler_roles import FakeClient, reporter, req, scheduler


def test_a_dropped_pause_is_reported_at_once_and_once() -> None:
    """A pause the data plane drops for good (here: under a custom logit processor) ends the
    coalescing and the next report names it (``pauses_dropped``), once: the control plane counts
    the request running at once rather than a step after the pause was due (session 79). Control:
    the same steady steps without the drop are coalesced."""
    client, inbox = FakeClient(), DecisionInbox()
    rep = reporter(client, inbox, scheduler(), interval=4)
    a, b = req("a"), req("b")
    a.to_finish = b.to_finish = None
    batch = SimpleNamespace(reqs=[a, b], sampling_info=SimpleNamespace(
        penalizer_orchestrator=None, has_custom_logit_processor=True), is_empty=lambda: False)

    def step(n: int) -> bool:
        inbox.take()
        return rep.end_step(batch, step=n, finished=(), is_decode=True, step_ms=10.0, layer_ms=None,
                            build_always=False)[1]

    assert [step(n) for n in (1, 2)] == [True, False]  # control: steady, coalesced
    assert rep.pauser.pause(batch, ["b"], step=3) == []  # dropped for good
    assert step(3) and client.reports[-1].pauses_dropped == ("b",)
    assert not rep.pauser.has_unreported_drops
    assert [step(n) for n in (4, 5, 6, 7)] == [False, False, False, True]
    assert client.reports[-1].pauses_dropped == ()
