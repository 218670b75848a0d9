"""AdmissionGate on plain objects: what SGLang's scheduler may prefill, and the order it keeps."""

from __future__ import annotations

from types import SimpleNamespace

from sglang_ext.admission import AdmissionGate, request_slo


class _Batch:
    def __init__(self, n: int) -> None:
        self.reqs = [object()] * n

    def is_empty(self) -> bool:
        return not self.reqs


def _sched(*rids: str) -> SimpleNamespace:
    return SimpleNamespace(waiting_queue=[SimpleNamespace(rid=r) for r in rids], chunked_req=None)


def _rids(s: SimpleNamespace) -> list[str]:
    return [r.rid for r in s.waiting_queue]


def test_only_admitted_requests_are_visible_then_order_is_restored():
    gate = AdmissionGate(enabled=True)
    s = _sched("a", "b", "c", "d")
    gate.admit(["c"])
    held = gate.hold_back(s, _Batch(2), pauser=())
    assert _rids(s) == ["c"]
    s.waiting_queue = []  # SGLang scheduled c
    gate.restore(s, held)
    assert _rids(s) == ["a", "b", "d"]
    assert gate.held_total == 3


def test_unscheduled_admitted_request_keeps_its_place():
    gate = AdmissionGate(enabled=True)
    s = _sched("a", "b", "c")
    gate.admit(["b"])
    held = gate.hold_back(s, _Batch(1), pauser=())
    gate.restore(s, held)  # SGLang had no room for b
    assert _rids(s) == ["a", "b", "c"]


def test_idle_server_lets_the_head_in_without_a_decision():
    """Work-conserving: nothing runs, nothing admitted -> the head of the queue goes in."""
    gate = AdmissionGate(enabled=True)
    s = _sched("a", "b")
    held = gate.hold_back(s, _Batch(0), pauser=())
    assert _rids(s) == ["a"] and gate.local_admits == 1
    gate.restore(s, held)
    assert _rids(s) == ["a", "b"]


def test_busy_server_holds_everything_until_admitted():
    gate = AdmissionGate(enabled=True)
    s = _sched("a", "b")
    held = gate.hold_back(s, _Batch(1), pauser=())
    assert _rids(s) == [] and gate.local_admits == 0
    gate.restore(s, held)
    assert _rids(s) == ["a", "b"]


def test_open_gate_and_disabled_gate_change_nothing():
    """Control plane unreachable (fallback) or fcfs: SGLang sees the whole queue."""
    for gate in (AdmissionGate(enabled=False), AdmissionGate(enabled=True)):
        gate.open = gate.enabled
        s = _sched("a", "b")
        assert gate.hold_back(s, _Batch(1), pauser=()) == []
        assert _rids(s) == ["a", "b"]


def test_admitted_ids_are_forgotten_once_they_leave_the_queue():
    gate = AdmissionGate(enabled=True)
    gate.admit(["gone", "a"])
    s = _sched("a")
    gate.hold_back(s, _Batch(1), pauser=())
    assert gate.admitted == {"a"}


def test_unknown_admitted_ids_do_not_wait_for_a_queued_request():
    """An admit naming no request of this worker (or one already gone) is forgotten at the next
    step even while nothing is queued (before, it stayed until a request queued). Control: an
    admitted request still queued stays admitted."""
    gate = AdmissionGate(enabled=True)
    gate.admit(["unknown"])
    assert gate.hold_back(_sched(), _Batch(1), pauser=()) == [] and gate.admitted == set()
    gate.admit(["a"])
    gate.hold_back(_sched("a", "b"), _Batch(1), pauser=())
    assert gate.admitted == {"a"}


def test_retracted_requests_added_during_the_call_go_after_the_queued_ones():
    gate = AdmissionGate(enabled=True)
    s = _sched("a", "b")
    gate.admit(["b"])
    held = gate.hold_back(s, _Batch(1), pauser=())
    s.waiting_queue = [SimpleNamespace(rid="r")]  # b scheduled, r retracted back to the queue
    gate.restore(s, held)
    assert _rids(s) == ["a", "r"]


def test_request_slo_reads_custom_params_and_ignores_bad_values():
    def req(custom):  # noqa: ANN001, ANN202
        return SimpleNamespace(sampling_params=SimpleNamespace(custom_params=custom))

    assert request_slo(req({"kvplane_slo_tbt_ms": 80})) == 80.0
    assert request_slo(req(None)) is None
    assert request_slo(req({"kvplane_slo_tbt_ms": -1})) is None
    assert request_slo(req({"other": 1})) is None


def test_a_prefill_that_just_ran_is_not_idle():
    """The prefill of the last step joins the running batch inside SGLang's get_next_batch_to_run,
    after the gate: with nothing running yet, the server is not idle, and the next queued
    request waits for the control plane's admit (it was let in locally, one boundary after
    the first). Controls: a decode or empty last batch, and none, leave the rule as it was."""
    from types import SimpleNamespace

    def last(n: int, extend: bool) -> object:
        batch = _Batch(n)
        batch.forward_mode = SimpleNamespace(is_extend=lambda: extend)
        return batch

    gate = AdmissionGate(enabled=True)
    s = _sched("b", "c")
    held = gate.hold_back(s, _Batch(0), pauser=(), last_batch=last(1, True))
    assert _rids(s) == [] and gate.local_admits == 0
    gate.restore(s, held)
    for other in (last(1, False), last(0, True), None):
        held = gate.hold_back(s, _Batch(0), pauser=(), last_batch=other)
        assert _rids(s) == ["b"], other
        gate.restore(s, held)
    assert gate.local_admits == 3
