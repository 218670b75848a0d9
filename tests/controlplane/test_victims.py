"""The starvation guard's victim choice: each rule, and requests about to finish passed over
(as the planner orders its victims)."""

from __future__ import annotations

import pytest

from controlplane.controller.schedulers.base import RequestView
from controlplane.controller.victims import finishing, select_victim


def _view(rid: str, context: int, generated: int = 3, max_new: int | None = None, paused: bool = False) -> RequestView:
    return RequestView(id=rid, context_tokens=context, generated_tokens=generated, slo_tbt_ms=100.0,
                       first_seen_ms=0.0, run_since_ms=0.0, last_token_ms=0.0, paused=paused,
                       max_new_tokens=max_new)


@pytest.mark.parametrize(("rule", "first", "second"), [
    ("largest", "big", "mid"), ("longest", "big", "mid"), ("shortest", "small", "mid"),
])
@pytest.mark.parametrize("left_after_next", [0, 1])
def test_a_request_about_to_finish_is_chosen_last(rule, first, second, left_after_next):
    """The rule's own choice, at most one token from its end after the next step, is passed over
    for the rule's next; with two tokens left (negative control) it is the victim again; when
    every candidate is finishing, the rule applies among them."""
    def views(left: int) -> list[RequestView]:
        sizes = {"big": 300, "mid": 200, "small": 100}
        return [_view(rid, n, generated=3, max_new=3 + 1 + left if rid == first else None)
                for rid, n in sizes.items()]

    assert select_victim(views(left_after_next), rule, block_size=16).id == second
    assert select_victim(views(2), rule, block_size=16).id == first
    all_finishing = [_view(rid, n, generated=9, max_new=10) for rid, n in (("a", 300), ("b", 100))]
    assert select_victim(all_finishing, rule, block_size=16).id == ("b" if rule == "shortest" else "a")


def test_finishing_needs_a_known_limit_and_a_running_request():
    assert finishing(_view("r", 10, generated=8, max_new=10))  # 1 left after the next token
    assert not finishing(_view("r", 10, generated=7, max_new=10))
    assert not finishing(_view("r", 10, generated=9, max_new=None))
    assert not finishing(_view("r", 10, generated=9, max_new=10, paused=True))  # a paused one is no victim here
