"""RequestPlacement: per-request placement records, opt-in, taken where the scheduler already
touches a request (arrival, plan install, pause / resume, release), on the real served core.

The KV side is the SGLang-free :class:`LayeredKVCore` driven like SGLang's forward
(``tests/dataplane/core_driver.py``), the plan goes through the real
:class:`~sglang_ext.tp_sync.PlacementInstaller`, the deposit comes from the real embedded
controller. SGLang's request and tree cache are stand-ins exposing the attributes kvplane reads
(``rid``, ``sampling_params.custom_params``, ``customized_info``; ``residency_hooks``,
``on_release``); the real ones are exercised by ``test_request_placement_server.py``.
"""

from __future__ import annotations

import gc
import json
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("torch")

from controlplane import api  # noqa: E402
from controlplane.embedded import EmbeddedControlPlane  # noqa: E402
from controlplane.model import Hardware, ModelSpec, Profile  # noqa: E402
from sglang_ext.hooks import ResidencyEventKind, ResidencyHooks  # noqa: E402
from sglang_ext.placement_record import RESULT_FIELDS  # noqa: E402
from sglang_ext.request_placement import (  # noqa: E402
    KEY,
    PARAM,
    RequestPlacement,
    placement_param_error,
    wants_placement,
)
from sglang_ext.tp_sync import PlacementInstaller, StepInstall  # noqa: E402
from tests.dataplane.core_driver import LAYERS, CoreDriver, make_core  # noqa: E402


class Req:
    """The attributes of SGLang's ``Req`` that kvplane reads (weak-referenceable like it)."""

    def __init__(self, rid: str, custom_params: Any = None) -> None:
        self.rid = rid
        self.sampling_params = SimpleNamespace(custom_params=custom_params)
        self.customized_info: dict | None = None


class Tree:
    """The tree cache's two attributes kvplane uses: its residency hub and ``on_release``."""

    def __init__(self) -> None:
        self.residency_hooks = ResidencyHooks()
        self.released: list[str] = []

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        self.released.append(req.rid)


class Scene:
    """A core with one 4-page request prefilled, an installer, a placement attached to a tree."""

    def __init__(self, *, layered: bool = True) -> None:
        self.core = make_core(device_pages=None)
        self.driver = CoreDriver(self.core)
        self.installer = PlacementInstaller(self.core if layered else None, LAYERS)
        self.tree = Tree()
        self.step = 10
        self.cp = EmbeddedControlPlane(synchronous=True)
        self.session: Any = None
        self.placement = RequestPlacement(
            layers=LAYERS,
            installer=self.installer,
            pool=self.core,
            pages_of=lambda req: self.driver.pages(req.rid) if req.rid in self.driver.slots else (),
            step_of=lambda: self.step,
            session_of=lambda: self.session,
            default_slo_of=lambda: self.cp.get_policy().slo_tbt_ms,
        )
        self.placement.attach(self.tree)

    def run(self, rid: str, tokens: int = 8) -> None:
        self.driver.add(rid)
        assert self.driver.step([(rid, tokens)])

    def install(self, rid: str, row: tuple[int, ...]) -> None:
        self.installer.apply(StepInstall(step=self.step, placements={rid: row}))
        self.installer.install({rid: self.driver.pages(rid)}, {})
        self.placement.installed()

    def release(self, req: Req) -> None:
        self.tree.on_release(req, checkpointed=True)


def test_only_requests_that_ask_get_a_record():
    """``true`` asks; absent, ``false``, another value or another key does not (negative control)."""
    assert wants_placement({PARAM: True})
    for custom in (None, {}, {PARAM: False}, {PARAM: "true"}, {PARAM: 1}, {"kvplane_slo_tbt_ms": 100}, [PARAM]):
        assert not wants_placement(custom), custom
    scene = Scene()
    asked, silent = Req("a", {PARAM: True}), Req("b", {PARAM: False})
    scene.placement.arrived(asked)
    scene.placement.arrived(silent)
    assert "a" in scene.placement and "b" not in scene.placement and scene.placement.active


def test_a_bad_opt_in_value_is_named_with_what_is_allowed():
    """Anything but a JSON boolean (or absent/null) is refused, naming the field and the value."""
    for ok in (None, {}, {PARAM: True}, {PARAM: False}, {PARAM: None}, "not a dict"):
        assert placement_param_error(ok) is None
    for bad in ("yes", 1, 0, [True], {"x": 1}):
        message = placement_param_error({PARAM: bad})
        assert message == f"custom_params.{PARAM}={json.dumps(bad)} is invalid (allowed: true or false)"


def test_release_attaches_the_record_once_to_the_final_output_only():
    """Scenario: a request that asked runs with layer 2 of 3 offloaded, is paused at step 10 and
    resumed at step 13, then released. Its record rides in ``customized_info[KEY]``; any slice
    SGLang's output streamer takes of it is the one record; the fields say 1 layer offloaded, a
    third of its layer-pages on host, one pause of 3 steps, the policy's default SLO."""
    scene = Scene()
    req = Req("r", {PARAM: True})
    scene.placement.arrived(req)
    scene.run("r")
    scene.install("r", (1, 1, 0))
    scene.tree.residency_hooks.emit(ResidencyEventKind.PAUSED, [], rid="r")
    scene.step = 13
    scene.tree.residency_hooks.emit(ResidencyEventKind.RESUMED, [], rid="r")
    scene.release(req)
    assert scene.tree.released == ["r"] and "r" not in scene.placement and not scene.placement.active
    values = req.customized_info[KEY]
    assert values[0:8] == values[5:6] == values[7:7] == [values[0]]  # every slice: the record once
    record = values[0]
    assert tuple(record) == RESULT_FIELDS
    assert record["layers"] == LAYERS and record["layers_offloaded"] == record["layers_offloaded_max"] == 1
    assert record["host_fraction"] == pytest.approx(1 / 3)
    assert (record["pauses"], record["paused_steps"]) == (1, 3)
    assert record["slo_tbt_ms"] == 200.0
    assert record["deposit_tokens"] is None and record["deposit_source"] is None  # no session here


def test_a_request_that_did_not_ask_is_released_untouched():
    """Negative control of the previous test: same run, no opt-in: no record, nothing attached,
    the release still reaches the tree."""
    scene = Scene()
    req = Req("r")
    scene.placement.arrived(req)
    scene.run("r")
    scene.install("r", (1, 1, 0))
    scene.release(req)
    assert scene.tree.released == ["r"] and req.customized_info is None


def test_all_resident_request_reports_nothing_offloaded():
    """Negative control of the offload figures: with every layer wanted on the device the same
    request reports 0 layers and a host fraction of 0."""
    scene = Scene()
    req = Req("r", {PARAM: True})
    scene.placement.arrived(req)
    scene.run("r")
    scene.install("r", (1, 1, 1))
    scene.release(req)
    record = req.customized_info[KEY][0]
    assert (record["layers_offloaded"], record["layers_offloaded_max"], record["host_fraction"]) == (0, 0, 0.0)


def test_max_over_life_keeps_the_most_offloaded_install():
    """Installs of 2, then 0 layers on host: ``layers_offloaded`` is the finish's (0), the max 2;
    installs while paused (all layers removable) do not count."""
    scene = Scene()
    req = Req("r", {PARAM: True})
    scene.placement.arrived(req)
    scene.run("r")
    scene.install("r", (1, 0, 0))
    scene.tree.residency_hooks.emit(ResidencyEventKind.PAUSED, [], rid="r")
    scene.install("r", (0, 0, 0))
    scene.tree.residency_hooks.emit(ResidencyEventKind.RESUMED, [], rid="r")
    scene.install("r", (1, 1, 1))
    scene.release(req)
    record = req.customized_info[KEY][0]
    assert (record["layers_offloaded"], record["layers_offloaded_max"]) == (0, 2)


def test_deposit_and_slo_come_from_the_embedded_controller():
    """With a live session the record carries the controller's deposit (tokens generated ahead of
    the SLO delivery schedule, as of its last report) and the request's own SLO when it set one."""
    scene = Scene()
    worker = api.WorkerInfo(
        worker_id="w", model=ModelSpec(layers=LAYERS, block_size=2, block_bytes=64),
        hardware=Hardware(gpu_kv_budget_blocks=1000, h2d_gbps=10.0), profile=Profile((0.5,) * LAYERS),
    )
    scene.session = scene.cp.open_session(worker)
    req = Req("r", {PARAM: True, "kvplane_slo_tbt_ms": 50})
    scene.placement.arrived(req)
    scene.run("r")
    for step, generated in ((1, 1), (2, 6)):  # 5 tokens 10 ms after the first: none is due yet
        scene.session.report(api.StepReport(
            step=step, now_ms=step * 10.0,
            running=(api.RequestState(id="r", context_tokens=8 + generated, generated_tokens=generated,
                                      slo_tbt_ms=50.0),),
        ))
    scene.release(req)
    record = req.customized_info[KEY][0]
    assert record["slo_tbt_ms"] == 50.0
    assert (record["deposit_tokens"], record["deposit_source"]) == (scene.session.deposit("r").balance, "controller")
    assert record["deposit_tokens"] == 5
    scene.cp.close()


def _plain_pool_record(row: tuple[int, ...] | None) -> dict:
    """The record of a request run on a plain pool (no residency), ``row`` installed for it first
    unless None."""
    scene = Scene(layered=False)
    req = Req("r", {PARAM: True})
    scene.placement.arrived(req)
    scene.run("r")
    if row is not None:
        scene.install("r", row)
    scene.release(req)
    return req.customized_info[KEY][0]


def test_without_the_layered_pool_the_plan_gives_the_layers_and_no_host_fraction():
    """A plain pool (no residency to read): layers on host come from the installed plan, the host
    fraction is unknown (None)."""
    record = _plain_pool_record((1, 0, 0))
    assert (record["layers_offloaded"], record["host_fraction"]) == (2, None)


def test_layers_offloaded_is_null_when_nothing_knows_the_request():
    """A plain pool and no plan installed for the request: its layers on host are unknown, reported
    as None (before session 85: 0, as if all were on the device), and the max stays 0. Control:
    the same request with a plan installed reports the plan's layers."""
    record = _plain_pool_record(None)
    assert (record["layers_offloaded"], record["layers_offloaded_max"], record["host_fraction"]) == (None, 0, None)
    record = _plain_pool_record((1, 1, 0))
    assert (record["layers_offloaded"], record["layers_offloaded_max"]) == (1, 1)


def test_records_of_requests_that_never_ran_do_not_leak():
    """A request that asked and was dropped without a release (aborted while queued) loses its
    record when SGLang lets go of it."""
    scene = Scene()
    req = Req("gone", {PARAM: True})
    scene.placement.arrived(req)
    assert "gone" in scene.placement
    del req
    gc.collect()
    assert "gone" not in scene.placement and not scene.placement.active


def test_a_retracted_request_keeps_its_record_for_its_final_output():
    """SGLang's retraction releases a request unfinished (``release_req``, then back to the queue,
    where ``arrived`` sees it again): its record, with the pause it had, is kept and nothing is
    attached to its output; at its real finish the one record carries that pause. Negative
    control, by hand: without the finished check the retraction attached a record (returned 2
    with the final one) and the re-queue started a fresh record with no pause."""
    scene = Scene()
    req = Req("r", {PARAM: True})
    req.finished = lambda: False  # type: ignore[attr-defined]
    scene.placement.arrived(req)
    scene.run("r")
    scene.tree.residency_hooks.emit(ResidencyEventKind.PAUSED, [], rid="r")
    scene.step = 18
    scene.tree.residency_hooks.emit(ResidencyEventKind.RESUMED, [], rid="r")
    scene.release(req)  # retract_decode's release
    assert req.customized_info is None and "r" in scene.placement and scene.placement.returned == 0
    scene.placement.arrived(req)  # _add_request_to_queue(req, is_retracted=True)
    req.finished = lambda: True  # type: ignore[attr-defined]
    scene.release(req)
    record = req.customized_info[KEY][0]
    assert (record["pauses"], record["paused_steps"]) == (1, 8) and scene.placement.returned == 1
