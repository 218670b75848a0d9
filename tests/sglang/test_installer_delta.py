"""PlacementInstaller installs only what changed: a batch change reads and sends the wants of the
requests whose policy changed (new ones included), not the whole batch's pages.

The pool is the real SGLang-free served core (:class:`LayeredKVCore`, offloading budget), driven
like SGLang's forward by ``tests/dataplane/core_driver.py``; the installer is the one the step
boundary runs (``StepBoundary.after_schedule`` passes the live requests and ``pages_of``). The
end state is compared with a full install of the same plan on a twin core: every request's
layers as the pool holds them, and the resident (layer, page) map.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")

from sglang_ext.tp_sync import PlacementInstaller, StepInstall  # noqa: E402
from tests.dataplane.core_driver import LAYERS, CoreDriver, make_core  # noqa: E402

BUDGET = 33 + 40
"""Device layer-pages: below every layer of every page (the paged layout: moves are real)."""
PLAN = {"a": (1, 0, 1), "b": (1, 1, 0), "c": (0, 1, 1)}


class Twin:
    """A driven core, an installer on it, and a ``pages_of`` that counts the requests it reads."""

    def __init__(self) -> None:
        self.core = make_core(BUDGET)
        self.driver = CoreDriver(self.core, seed=3)
        self.installer = PlacementInstaller(self.core, LAYERS)
        self.read: list[str] = []
        self.sent: list[list[str]] = []
        update = self.core.update_residency

        def update_residency(wants: Any) -> Any:
            self.sent.append(sorted(wants))
            return update(wants)

        self.core.update_residency = update_residency  # type: ignore[method-assign]

    def pages_of(self, rid: str) -> tuple[int, ...]:
        self.read.append(rid)
        return self.driver.pages(rid)

    def run(self, rid: str, tokens: int = 5) -> None:
        self.driver.add(rid)
        assert self.driver.step([(rid, tokens)])

    def install(self, rids: list[str], plan: dict[str, tuple[int, ...]], paused: tuple[str, ...] = ()) -> None:
        self.installer.apply(StepInstall(step=1, placements=dict(plan)))
        live = {rid: rid for rid in rids if rid not in paused}
        self.installer.install(live, {rid: rid for rid in paused}, self.pages_of)

    def state(self) -> tuple[dict[str, tuple[bool, ...]], list]:
        self.core.settle()
        res = self.core.residency
        return ({rid: res.gpu_layers(rid) for rid in sorted(self.driver.slots)},
                (self.core.store.map_np >= 0).tolist())


def test_a_batch_change_reads_and_sends_only_the_changed_requests():
    """Three requests installed; a fourth arrives (unplanned: all layers on the GPU) and one
    request's placement changes: the install reads the pages of, and sends, those two only, and
    the pool ends where a full install of the same plan leaves a twin core (negative control of
    the comparison: the twin before its own change differs). ``last_wants`` keeps all four."""
    delta, full = Twin(), Twin()
    for twin in (delta, full):
        for rid in ("a", "b", "c"):
            twin.run(rid)
        twin.install(["a", "b", "c"], PLAN)
        twin.run("d")
    assert delta.read == ["a", "b", "c"] and delta.sent == [["a", "b", "c"]]
    delta.read.clear()
    before = full.state()
    changed = {**PLAN, "b": (0, 0, 1)}
    delta.install(["a", "b", "c", "d"], changed)
    assert sorted(delta.read) == ["b", "d"] and delta.sent[-1] == ["b", "d"]
    assert sorted(delta.installer.last_wants) == ["a", "b", "c", "d"]
    full.installer = PlacementInstaller(full.core, LAYERS)  # no memory of earlier installs: sends all
    full.install(["a", "b", "c", "d"], changed)
    assert full.sent[-1] == ["a", "b", "c", "d"]
    assert delta.state() == full.state()
    assert before != full.state()  # the change moved something: the comparison can fail
    assert delta.state()[0]["b"] == (False, False, True) and delta.state()[0]["d"] == (True,) * LAYERS


def test_nothing_changed_sends_nothing_and_a_pause_sends_the_paused_one():
    """The same policy again (a reordered batch) reads no pages and does not call the pool; a
    pause sends the paused request alone, with no layer on the GPU."""
    twin = Twin()
    for rid in ("a", "b", "c"):
        twin.run(rid)
    twin.install(["a", "b", "c"], PLAN)
    twin.read.clear()
    calls = len(twin.sent)
    twin.install(["c", "a", "b"], PLAN)
    assert twin.read == [] and len(twin.sent) == calls
    twin.install(["a", "b", "c"], PLAN, paused=("c",))
    assert twin.read == ["c"] and twin.sent[-1] == ["c"]
    assert twin.installer.last_wants["c"].paused and not any(twin.installer.last_wants["c"].gpu_layers)


def test_a_request_the_pool_released_without_a_finish_is_installed_again():
    """SGLang retracts a running request under memory pressure: its KV is released through the
    tree cache (``on_release`` -> the pool's ``release_request``), not through a finish, so the
    installer still remembers its policy. When it runs again its wants are sent again (the pool
    ``holds_wants`` none) and the pool holds its planned layers. Negative control: an installer
    that trusted its memory leaves the returning request unplanned (every layer on the GPU)."""
    for trust_memory in (False, True):
        twin = Twin()
        for rid in ("a", "b"):
            twin.run(rid)
        twin.install(["a", "b"], PLAN)
        assert twin.core.holds_wants("a")
        twin.core.release_request("a")  # retracted: released in the pool, not finished
        assert not twin.core.holds_wants("a")
        twin.driver.finish("a")
        twin.run("a")  # re-admitted under the same rid: observed by its prefill, unplanned
        twin.run("c")
        if trust_memory:
            twin.core.holds_wants = lambda rid: True  # type: ignore[method-assign]
        twin.read.clear()
        twin.install(["a", "b", "c"], PLAN)  # a third request arrives with it
        state = twin.state()[0]
        if trust_memory:
            assert twin.read == ["c"] and state["a"] == (True,) * LAYERS
        else:
            assert sorted(twin.read) == ["a", "c"] and state["a"] == tuple(bool(x) for x in PLAN["a"])


def test_a_refused_install_is_sent_again_by_the_next_install_not_every_step():
    """The pool refuses an install (``update_residency`` raises; the step boundary logs it): the
    installer does not retry at every boundary (the same policy again installs nothing), keeps
    the wants the pool held in ``last_wants``, and the next install -- a request arrives -- sends
    the refused request again with the new one, so the pool ends at the plan. Negative control:
    an installer that forgot the refusal sends only the new request, and b stays where it was."""
    for remember in (True, False):
        twin = Twin()
        for rid in ("a", "b", "c"):
            twin.run(rid)
        twin.install(["a", "b", "c"], PLAN)
        update = twin.core.update_residency

        def refuse(wants: Any) -> Any:
            raise RuntimeError("device pool full")

        twin.core.update_residency = refuse  # type: ignore[method-assign]
        changed = {**PLAN, "b": (0, 0, 1)}
        with pytest.raises(RuntimeError, match="device pool full"):
            twin.install(["a", "b", "c"], changed)
        twin.core.update_residency = update  # type: ignore[method-assign]
        assert twin.installer.last_wants["b"].gpu_layers == (True, True, False)  # what the pool holds
        assert twin.installer.unchanged(["a", "b", "c"], [])  # no retry at every boundary
        if not remember:
            twin.installer._unsent.clear()
        twin.run("d")
        twin.install(["a", "b", "c", "d"], changed)
        state = twin.state()[0]
        if remember:
            assert twin.sent[-1] == ["b", "d"] and state["b"] == (False, False, True)
            assert twin.installer.last_wants["b"].gpu_layers == (False, False, True)
        else:
            assert twin.sent[-1] == ["d"] and state["b"] == (True, True, False)
