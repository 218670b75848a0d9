"""``SGLANG_REQ_RUNNING_TIMEOUT`` reaches parked requests (``parked_lifecycle.around_poll_timeout_aborts``).

SGLang 0.5.23's own ``Scheduler._poll_timeout_aborts`` (the real method, unbound) runs on a
scheduler holding the part of its state the method reads: a waiting queue and its in-flight
batches. A request kvplane parked is in neither, so without the hook it never timed out and kept
its KV for good. The abort the hook emits then resumes the request through ``around_abort``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("sglang")

from sglang.srt.managers.scheduler import Scheduler  # noqa: E402  (imported before any request's clock starts)

from sglang_ext import compat, parked_lifecycle  # noqa: E402
from tests.sglang.test_parked_lifecycle import _batch, _fresh_sampling, _scheduler  # noqa: E402,F401

TIMEOUT_S = 5.0


@dataclass
class _TimedReq:
    """A decoding request, as far as SGLang's timeout scan and kvplane's pause read it."""

    rid: str
    age_s: float
    """Seconds since its first forward (SGLang's ``time_stats.forward_entry_time``)."""
    done: bool = False
    to_finish: object = None
    output_ids: list[int] = field(default_factory=lambda: [0, 0])
    sampling_params: Any = field(default_factory=lambda: SimpleNamespace(max_new_tokens=None))
    time_stats: Any = None

    def __post_init__(self) -> None:
        self.time_stats = SimpleNamespace(forward_entry_time=time.perf_counter() - self.age_s)

    def finished(self) -> bool:
        return self.done


def _sglang_poll() -> Any:
    return Scheduler._poll_timeout_aborts


def _parked_scheduler(*reqs: _TimedReq, park: tuple[str, ...]) -> Any:
    sched = _scheduler()
    sched.running_batch = _batch(*reqs)
    assert sched._kvplane.pauser.pause(sched.running_batch, list(park), step=1) == list(park)
    sched.last_batch = None
    sched._collect_inflight_batches = lambda: [sched.running_batch, sched.last_batch]
    return sched


def _poll(sched: Any) -> list[str]:
    return [abort.rid for abort in parked_lifecycle.around_poll_timeout_aborts(_sglang_poll(), sched)]


def test_a_parked_request_past_sglangs_running_timeout_is_aborted_and_resumed_into_the_abort(monkeypatch):
    """``old`` runs and ``stale`` is parked, both older than the timeout; ``fresh`` is parked and
    young. SGLang alone aborts ``old`` only (control: the parked one is invisible to it); with the
    hook ``stale`` too, with SGLang's message and status, and not ``fresh``. The abort then
    resumes ``stale`` so SGLang's abort of a running request finishes it; ``fresh`` stays parked."""
    monkeypatch.setenv("SGLANG_REQ_RUNNING_TIMEOUT", str(TIMEOUT_S))
    sched = _parked_scheduler(_TimedReq("old", 60.0), _TimedReq("stale", 60.0), _TimedReq("fresh", 0.0),
                              park=("stale", "fresh"))
    assert [abort.rid for abort in _sglang_poll()(sched)] == ["old"]  # control: SGLang alone
    aborts = parked_lifecycle.around_poll_timeout_aborts(_sglang_poll(), sched)
    assert [abort.rid for abort in aborts] == ["old", "stale"]
    assert aborts[1].abort_message == aborts[0].abort_message == "Request running timeout reached."
    assert aborts[1].finished_reason == aborts[0].finished_reason

    seen: list[list[str]] = []
    parked_lifecycle.around_abort(lambda s, r: seen.append([q.rid for q in s.running_batch.reqs]), sched, aborts[1])
    assert seen == [["old", "stale"]] and sched._kvplane.pauser.paused_ids == ("fresh",)


def test_no_timeout_no_parked_request_or_one_already_aborted_adds_nothing(monkeypatch):
    """Controls: the timeout unset (SGLang's default, -1), nothing parked, and a parked request
    that SGLang's scan already named (parked by the step still in its ``last_batch``) or that is
    finishing (``to_finish`` set) are not aborted (again)."""
    monkeypatch.delenv("SGLANG_REQ_RUNNING_TIMEOUT", raising=False)
    sched = _parked_scheduler(_TimedReq("old", 60.0), _TimedReq("stale", 60.0), park=("stale",))
    assert _poll(sched) == []
    monkeypatch.setenv("SGLANG_REQ_RUNNING_TIMEOUT", str(TIMEOUT_S))
    assert _poll(sched) == ["old", "stale"]
    sched.last_batch = _batch(*sched._kvplane.pauser.parked()[0].batch.reqs)  # the step that parked it
    assert _poll(sched) == ["old", "stale"]
    sched._kvplane.pauser.parked()[0].req.to_finish = "aborting"
    sched.last_batch = None
    assert _poll(sched) == ["old"]
    empty = _parked_scheduler(_TimedReq("old", 60.0), park=())
    assert _poll(empty) == ["old"] and len(empty._kvplane.pauser) == 0


def test_the_hook_is_registered_on_sglangs_method():
    """``scheduler_hooks.register`` wraps the compat target (a renamed method fails the compat
    check, not silently here)."""
    from sglang_ext import scheduler_hooks

    registered: list[tuple[str, Any]] = []
    registry = SimpleNamespace(register=lambda path, hook, kind: registered.append((path, hook)))
    scheduler_hooks.register(registry, SimpleNamespace(AFTER="after", AROUND="around"), ctx=None)
    assert (compat.SCHEDULER_POLL_TIMEOUT_ABORTS.path, parked_lifecycle.around_poll_timeout_aborts) in registered
