"""A step boundary's record reaches a stats line even when no processed step takes it before the
next boundary (:meth:`StepBoundary.take_record`, :func:`merged_record`).

SGLang's overlap loop processes no step after the boundary that follows an idle iteration
(``last_batch`` is None there): every running request finishing in the step in flight leaves the
next batch empty, the boundary after it resumes the parked requests, and the stats line written
next is taken a boundary later. Before the fix that boundary's record was overwritten: the
differential fuzzer's stats lines missed 15-19% of the resumes its events file recorded."""

from __future__ import annotations

from controlplane.api import Decision
from controlplane.model import Plan
from sglang_ext.admission import AdmissionGate
from sglang_ext.decision_inbox import DecisionInbox
from sglang_ext.pause import PauseManager
from sglang_ext.step_boundary import StepBoundary, merged_record
from sglang_ext.tp_sync import PlacementInstaller, TpSync
from tests.sglang.test_pause_drop_finished import _Batch
from tests.sglang.test_pause_finishing import _Req
from tests.sglang.test_scheduler_roles import FakeClient

PLAN = Plan(True, (), {}, 1.0, 8, 0, 0, "test", 0.0)


def _boundary(inbox: DecisionInbox, keep_record: bool = True) -> StepBoundary:
    return StepBoundary(
        tp=TpSync(0, 1), installer=PlacementInstaller(None, 2), pauser=PauseManager(),
        admission=AdmissionGate(enabled=False), inbox=inbox, client=FakeClient(), pages_of=lambda r: (),
        keep_record=keep_record,
    )


def test_a_record_no_step_took_is_carried_into_the_next_line():
    """Boundary 1 pauses b and skips a finishing a; boundary 2 pauses c; no step is processed
    between them: the one line taken after boundary 2 holds both boundaries' pauses, skips and
    decisions. Negative control: the line taken after boundary 2 alone, before the fix, held
    only c (this test's first assertion fails on that code: ``['c']``)."""
    inbox = DecisionInbox()
    boundary = _boundary(inbox)
    running = _Batch([_Req("a", 7, 8), _Req("b", 1, 8), _Req("c", 1, 8), _Req("d", 1, 8),
                      _Req("e", 1, 8)])  # e keeps the batch going (no pause is would_idle)
    inbox.receive([Decision(plan=PLAN, apply_at_step=0, expiry_step=10, pause=("a", "b"), reason="first")])
    boundary.apply(running, None, step=4)
    inbox.receive([Decision(plan=PLAN, apply_at_step=0, expiry_step=10, pause=("c",), reason="second")])
    boundary.apply(running, None, step=4)  # same step: nothing was processed in between
    record = boundary.take_record()
    assert record["paused_now"] == ["b", "c"]
    assert record["pauses_skipped"] == {"finishing": 2}  # a's deferred pause was retried and skipped again
    assert record["decision"] == "first,second"
    assert boundary.take_record() == {}  # taken: the next line starts empty

    inbox.receive([Decision(plan=PLAN, apply_at_step=0, expiry_step=10, pause=("d",), reason="third")])
    boundary.apply(running, None, step=5)
    assert boundary.take_record()["paused_now"] == ["d"]  # control: a taken record is not carried twice


def test_quiet_boundaries_of_an_idle_server_carry_nothing():
    """An idle server runs a boundary every loop iteration and processes no step: quiet records
    are not accumulated (nothing to carry), so the next line is one quiet record."""
    boundary = _boundary(DecisionInbox())
    for _ in range(1000):
        boundary.apply(_Batch([]), None, step=9)
    assert boundary._carried == {}
    assert boundary.take_record() == {
        "admitted_now": [], "paused_now": [], "resumed_now": [], "pauses_skipped": {}, "decision": None,
        "fallback": False,
    }


def test_merged_records_sum_moves_and_keep_the_latest_fallback():
    first = {"admitted_now": ["q"], "paused_now": ["a"], "resumed_now": [], "pauses_skipped": {"finishing": 1},
             "decision": None, "fallback": True, "install_delta": {"loaded_layer_pages": 3, "h2d_bytes": 10}}
    then = {"admitted_now": [], "paused_now": [], "resumed_now": ["a"], "pauses_skipped": {"batch_feature": 2},
            "decision": "expiry", "fallback": False, "install_delta": None}
    assert merged_record(first, then) == {
        "admitted_now": ["q"], "paused_now": ["a"], "resumed_now": ["a"],
        "pauses_skipped": {"finishing": 1, "batch_feature": 2}, "decision": "expiry", "fallback": False,
        "install_delta": {"loaded_layer_pages": 3, "h2d_bytes": 10},
    }
    both = merged_record(first, dict(then, install_delta={"loaded_layer_pages": 1, "d2h_bytes": 4}))
    assert both["install_delta"] == {"loaded_layer_pages": 4, "h2d_bytes": 10, "d2h_bytes": 4}
    assert merged_record(then, first)["fallback"] is True  # control: the later record's fallback wins


def test_a_shortfall_is_a_level_the_latest_install_holds_not_a_sum():
    """``shortfall_layer_pages`` is what an install left short, a state: two carried installs that
    both left the same 5 pages short merge to 5 (summed, the stats line read 10 -- the negative
    control: drop ``_LEVELS`` and this fails). The latest holds, also when it is 0 (it fitted);
    moves beside it are still summed, and an install without the field keeps the earlier one."""
    short = {"install_delta": {"shortfall_layer_pages": 5, "loaded_layer_pages": 2}}
    assert merged_record(short, short)["install_delta"] == {"shortfall_layer_pages": 5, "loaded_layer_pages": 4}
    fitted = {"install_delta": {"shortfall_layer_pages": 0, "loaded_layer_pages": 1}}
    assert merged_record(short, fitted)["install_delta"] == {"shortfall_layer_pages": 0, "loaded_layer_pages": 3}
    moves = {"install_delta": {"loaded_layer_pages": 1}}
    assert merged_record(short, moves)["install_delta"] == {"shortfall_layer_pages": 5, "loaded_layer_pages": 3}


def test_nothing_is_carried_where_no_stats_line_takes_the_records():
    """Without a stats file (and on every TP rank but 0) no line ever calls :meth:`take_record`:
    the boundaries carry nothing, so a long-running server's boundary does not grow with every
    request it paused, resumed or admitted. Control: with a stats line (``keep_record``) the same
    boundaries carry their records until a line takes them."""
    carried = {}
    for keep in (False, True):
        inbox = DecisionInbox()
        boundary = _boundary(inbox, keep_record=keep)
        running = _Batch([_Req(f"r{i}", 1, 8) for i in range(51)])  # r50 keeps running
        for i in range(50):
            inbox.receive([Decision(plan=PLAN, apply_at_step=0, expiry_step=10**6, pause=(f"r{i}",),
                                    reason=f"d{i}")])
            boundary.apply(running, None, step=4)
            boundary.note_resumed([f"x{i}"])
        carried[keep] = boundary._carried
    assert carried[False] == {}
    assert len(carried[True]["paused_now"]) >= 49 and len(carried[True]["resumed_now"]) == 50
