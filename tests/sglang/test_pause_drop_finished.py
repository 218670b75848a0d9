"""PauseManager.drop_finished: under SGLang's overlap loop a request parked at step k+1's boundary
can finish when step k (still in flight at the boundary) is processed; it must leave the pauser."""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_ext.pause import PauseManager


@dataclass
class _Req:
    rid: str
    done: bool = False
    to_finish: object = None

    def finished(self) -> bool:
        return self.done


@dataclass
class _Batch:
    """The part of SGLang's ScheduleBatch the pauser touches (``pause`` splits one row off)."""

    reqs: list[_Req] = field(default_factory=list)
    sampling_info: object = None
    batch_is_full: bool = False

    def is_empty(self) -> bool:
        return not self.reqs

    def filter_batch(self, keep_indices: list[int]) -> None:
        self.reqs = [self.reqs[i] for i in keep_indices]


def test_a_request_that_finished_while_parked_is_dropped_and_one_still_decoding_stays():
    pauser = PauseManager()
    a, b = _Req("a"), _Req("b")
    running = _Batch([a, b, _Req("c")])
    assert pauser.pause(running, ["a", "b"], step=5) == ["a", "b"]
    a.done = True  # step k's result ended it after the boundary parked it
    assert pauser.drop_finished(["a", "b", "z"]) == ["a"]  # b is parked but not finished; z unknown
    assert pauser.paused_ids == ("b",)
    assert pauser.drop_finished(["b"]) == []  # negative control: an unfinished parked request stays
    assert "b" in pauser
