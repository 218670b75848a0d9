"""The CUDA engine's stream and event protocol, checked on the CPU (``stream_order.py``).

The served core runs with :class:`CudaTransferEngine` over CPU pools, its streams and events
simulated with vector clocks, and every access to the KV pools is checked against the
happens-before order they define. These tests are not GPU measurements: they check that no copy
and no layer can touch KV before what it depends on is ordered before it, which on a GPU is
the difference between exact KV and KV corrupted when a copy happens to run late.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant

from sglang_ext.dataplane import cuda_transfer_engine as te
from sglang_ext.dataplane.pinned_upload_ring import PinnedUploadRing
from tests.dataplane import test_core_stateful as stateful
from tests.dataplane.core_driver import LAYERS, PAGES, CoreDriver, make_core, offload_scenario
from tests.dataplane.cuda_simulation import install, track_core
from tests.dataplane.stream_order import ALWAYS, NEVER, RINGS, StreamOrder


def scenario(monkeypatch: pytest.MonkeyPatch, patch: Callable[[pytest.MonkeyPatch], None] | None = None,
             query_completes: str = NEVER, more_steps: int = 0, dma: bool = False,
             dma_floor: int = 0) -> tuple[StreamOrder, CoreDriver]:
    """The offloading scenario (plan changes, staged steps, write-backs) on the simulated engine,
    then ``more_steps`` decode steps of both requests, each after a plan change."""
    with monkeypatch.context() as mp:  # install()'s patches undone after the run
        sim = install(mp, query_completes, dma, dma_floor)
        if patch is not None:
            patch(mp)
        core = make_core(PAGES + 6)
        track_core(sim, core)
        driver = CoreDriver(core, seed=1, fast_decode=True)
        with sim.tracer():
            offload_scenario(driver)
            for i in range(more_steps):
                driver.want("a", [i % 2 == 0, True, False])
                driver.want("b", [False, i % 3 == 0, True])
                assert driver.step([("a", 1), ("b", 1)])
    return sim, driver


def test_the_offloading_scenario_keeps_every_access_ordered(monkeypatch):
    """Fetches, write-backs, parked tokens, layers' writes and reads: every access to the pools
    follows what it depends on, through the engine's events alone."""
    sim, driver = scenario(monkeypatch)
    stats = driver.core.store.engine.stats
    assert isinstance(driver.core.store.engine, te.CudaTransferEngine)
    assert stats.h2d_launches >= 10 and stats.d2h_launches >= 5, stats
    assert sim.accesses >= 150, sim.accesses
    assert sim.violations == []


@pytest.mark.parametrize("query_completes", [NEVER, RINGS, ALWAYS])
def test_longer_runs_keep_every_access_ordered_under_each_query_schedule(monkeypatch, query_completes):
    """Twenty more decode steps after plan changes, with the queries of events answered never,
    for the upload rings only, or always: still no unordered access; every ring took slots (the
    map mirror's columns went up through its own); with the rings' queries done the rings reuse
    their slots (none added)."""
    sim, driver = scenario(monkeypatch, query_completes=query_completes, more_steps=20)
    assert sim.violations == []
    store = driver.core.store
    rings = (store.uploads, store.engine._indices, store.mirror._ring)  # the mirror's: its device path
    assert sum(r.takes for r in rings) >= 60 and all(r.takes for r in rings)
    if query_completes != NEVER:
        assert sum(r.added for r in rings) == 0


def _on_overlap_streams(sim: StreamOrder, driver: CoreDriver, barrier: bool,
                        after: Callable[[], None] | None = None) -> Any:
    """``driver``'s forwards run as SGLang's overlap loop runs them: each on the forward stream,
    which waits for the schedule stream (the current one) at launch; after it, back on the
    schedule stream, which waits for the forward stream (``barrier``: SGLang's WAR barrier) --
    then ``after()``. Returns the schedule stream."""
    schedule, forward = sim.current, torch.cuda.Stream()
    real_step = driver.step

    def step(batch):  # noqa: ANN001, ANN202
        forward.wait_event(schedule.record_event())
        sim.set_stream(forward)
        try:
            return real_step(batch)
        finally:
            sim.set_stream(schedule)
            if barrier:
                schedule.wait_event(forward.record_event())
            if after is not None:
                after()

    driver.step = step  # type: ignore[method-assign]
    return schedule


def _overlap_loop(monkeypatch: pytest.MonkeyPatch, barrier: bool, churn: bool = False,
                  queries: str = RINGS, churn_patch: Callable[[pytest.MonkeyPatch], None] | None = None,
                  ) -> tuple[StreamOrder, CoreDriver]:
    """The offloading scenario and 20 more steps under SGLang's overlap loop's streams
    (``docs/overlap-schedule.md``): plan installs and the at-rest checks on the schedule stream,
    each forward on the forward stream, which waits for the schedule stream when it is launched
    (``forward_stream.wait_stream(schedule_stream)``); after each launch the schedule stream waits
    for the forward stream (``Scheduler._apply_war_barrier``, whole-forward: ``barrier``). ``churn``:
    then requests end and arrive (``churn_patch``: applied at the first end)."""
    with monkeypatch.context() as mp:  # install()'s patches undone after the run
        sim = install(mp, queries)
        core = make_core(PAGES + 6)
        track_core(sim, core)
        driver = CoreDriver(core, seed=1, fast_decode=True)
        _on_overlap_streams(sim, driver, barrier)
        with sim.tracer():
            offload_scenario(driver)
            for i in range(20):
                driver.want("a", [i % 2 == 0, True, False])
                driver.want("b", [False, i % 3 == 0, True])
                assert driver.step([("a", 1), ("b", 1)])
            if churn:  # results of a forward are processed after the next one is launched: the
                # requests finishing in the forward in flight release their pages, new ones take them
                for i in range(12):
                    assert driver.step([(rid, 1) for rid in ("a", "b", "c") if rid in driver.slots])
                    old, new = ("a", "c") if i % 2 == 0 else ("c", "a")
                    driver.finish(old)
                    if churn_patch is not None and i == 0:
                        churn_patch(mp)
                    driver.want("b", [i % 2 == 1, True, i % 3 == 0])  # moves into the freed pages
                    driver.add(new)
                    assert driver.step([("b", 1), (new, 5)])
                    driver.want(new, [i % 3 == 0, False, True])
            driver.check_at_rest()
    return sim, driver


def test_the_overlap_loops_streams_keep_every_access_ordered(monkeypatch):
    """Under the overlap loop the boundary's copies and the at-rest checks run on the schedule
    stream while the forward runs on its own: SGLang's whole-forward WAR barrier (the premise
    ``tests/sglang/test_war_barrier.py`` checks) keeps every access ordered; without it the
    boundary's copies overtake the forward in flight (the negative control)."""
    sim, _ = _overlap_loop(monkeypatch, barrier=True)
    assert sim.violations == [] and sim.accesses > 1000
    sim, _ = _overlap_loop(monkeypatch, barrier=False)
    assert any("not ordered after" in v and "stream4" in v for v in sim.violations), sim.violations[:3]


def test_requests_ending_in_the_forward_in_flight_release_their_pages_in_order(monkeypatch):
    """Scenario: under the overlap loop a forward's results are processed after the next forward
    is launched, so a request that ends there is released while a forward reading its pages is
    in flight; the next boundary moves another request's layers, and the next arrival's prefill
    takes pages. Every reuse stays ordered (query schedules never and rings), KV exact at every
    step and at rest. The control drops the boundary's fence from the first end on: the churn's
    copies then overwrite pages a copy is still reading."""
    for queries in (NEVER, RINGS):
        with monkeypatch.context() as mp:
            sim, driver = _overlap_loop(mp, barrier=True, churn=True, queries=queries)
        assert sim.violations == [] and driver.finishes == 12, (sim.violations[:3], driver.finishes)
    with monkeypatch.context() as mp:
        sim, _ = _overlap_loop(mp, barrier=True, churn=True, queries=NEVER, churn_patch=_no_fence)
    assert any(v.startswith("write by stream2") and "after a read by stream3" in v for v in sim.violations), \
        sim.violations[:3]


def _ring_releases_at_take(mp: pytest.MonkeyPatch) -> None:
    real = PinnedUploadRing.take

    def take(self, nbytes):  # noqa: ANN001, ANN202
        buf = real(self, nbytes)
        at = self._at
        if self._events[at] is None:
            self._events[at] = self._new_event()
        event = self._events[at]
        type(event).record(event, self._streams[at])  # released before its upload is enqueued
        event.record = lambda stream=None: None  # and never again
        return buf

    mp.setattr(PinnedUploadRing, "take", take)


def test_a_ring_slot_released_before_its_upload_is_caught(monkeypatch):
    """Negative control of the rings' release events: a slot released when taken (before the
    upload that reads it is enqueued) is rewritten by the host while that upload may still read it."""
    sim, _ = scenario(monkeypatch, _ring_releases_at_take, query_completes=RINGS, more_steps=20)
    assert any("write by host" in v and "after a read by compute" in v for v in sim.violations), sim.violations[:3]


def _no_layer_waits(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(te.CudaTransferEngine, "stream_wait", lambda self, events: None)


def _no_fence(mp: pytest.MonkeyPatch) -> None:
    def wait_fence(self: te.CudaTransferEngine) -> None:
        self._compute = torch.cuda.current_stream(self.device)
        self._fresh = False

    mp.setattr(te.CudaTransferEngine, "wait_fence", wait_fence)


def _launches_wait_nothing(mp: pytest.MonkeyPatch) -> None:
    real = te.CudaTransferEngine._on_stream

    def on_stream(self, kind, wait, copy, keep, nbytes=0):  # noqa: ANN001, ANN202
        stream = self.h2d_stream if kind == "h2d" else self.d2h_stream
        stream.wait_event = lambda event: None
        try:
            return real(self, kind, wait, copy, keep, nbytes)
        finally:
            del stream.wait_event

    mp.setattr(te.CudaTransferEngine, "_on_stream", on_stream)


def _no_record_stream(mp: pytest.MonkeyPatch) -> None:
    real = te.CudaTransferEngine._on_stream

    def on_stream(self, kind, wait, copy, keep, nbytes=0):  # noqa: ANN001, ANN202
        return real(self, kind, wait, copy, (), nbytes)  # nothing named to the caching allocator

    mp.setattr(te.CudaTransferEngine, "_on_stream", on_stream)


@pytest.mark.parametrize(("broken", "expected"), [
    # a layer reads its staged pages before their fetch
    (_no_layer_waits, ("read by compute (aten.index.Tensor)", "after a write by stream2")),
    # the step's layers start before the boundary's copies
    (_no_fence, ("by compute (aten.", "after a write by stream2")),
    # a write-back (the D2H stream, stream3) reads a page before the layer wrote it
    (_launches_wait_nothing, ("read by stream3 (aten.index_select", "after a write by compute")),
    # a copy reads indices the caching allocator may hand out again before it ran
    (_no_record_stream, ("reads a device tensor allocated on compute", "without record_stream(stream")),
])
def test_each_missing_wait_is_caught(monkeypatch, broken, expected):
    """Negative controls: the same scenario with one of the engine's waits removed has unordered
    accesses (on a GPU: KV read or copied before it is there), each of the kind that wait orders
    (stream2 is the engine's H2D stream, stream3 its D2H stream)."""
    sim, _ = scenario(monkeypatch, broken)
    assert any(all(part in v for part in expected) for v in sim.violations), sim.violations[:5]


def _onload_then_fast_steps(monkeypatch: pytest.MonkeyPatch) -> tuple[StreamOrder, CoreDriver]:
    with monkeypatch.context() as mp:  # install()'s patches undone after the run
        sim = install(mp)
        core = make_core(None, pages=stateful.BIG)
        track_core(sim, core)
        driver = CoreDriver(core, seed=0, fast_decode=True)
        with sim.tracer():
            driver.add("a")
            driver.step([("a", 1)])
            driver.want("a", [False] * LAYERS)
            driver.want("a", [True] * LAYERS)
            for _ in range(2):
                driver.step([("a", 1)])
    return sim, driver


def test_identity_fast_decode_waits_for_a_plans_moves(monkeypatch):
    """Scenario: identity layout (the budget holds every layer-page), a request's layers offloaded
    and then wanted back by a plan between two forwards of the same batch; the next forward is a
    steady decode step, which takes the journalled fast path (no tables, no pipeline). Its layers
    write and read the pages the plan's H2D fills: they must wait for it. Before the fix the
    fast path never waited (found by this checker's state machine)."""
    sim, driver = _onload_then_fast_steps(monkeypatch)
    assert driver.fast_steps == 2
    assert sim.violations == []
    # negative control: without the fast path's fence the same run reads before the H2D
    monkeypatch.setattr(te.CudaTransferEngine, "fence_pending", property(lambda self: False))
    sim, driver = _onload_then_fast_steps(monkeypatch)
    assert driver.fast_steps == 2
    assert any("by compute" in v and "by stream" in v for v in sim.violations), sim.violations[:3]


def _recompute_step(monkeypatch: pytest.MonkeyPatch) -> StreamOrder:
    with monkeypatch.context() as mp:  # install()'s patches undone after the run
        sim = install(mp)
        core = make_core(3 * stateful.BIG - 9, pages=stateful.BIG)
        track_core(sim, core)
        driver = CoreDriver(core, seed=0)
        with sim.tracer():
            driver.want("a", [False] * LAYERS)
            driver.add("a")
            for _ in range(4):
                driver.step([("a", 1)])
            driver.recompute["a"] = (2, 2)
            driver.want("a", [False] * LAYERS, uncached=2)
            driver.step([("a", 1)])
    assert driver.recompute_rows > 0 and core.store.engine.stats.d2h_launches >= LAYERS
    return sim


def test_a_layer_writing_a_staging_page_waits_for_the_last_layers_write_back(monkeypatch):
    """Scenario: a request whose every layer is on host runs a recompute decode step (the general
    tables, which write the staged new tokens back after each layer). Its new token's page has no
    KV on host at the next layer, so nothing is fetched into the staging page there: the layer's
    KV write must still wait for the write-back of the previous layer reading that page (on a GPU
    it would overwrite the page under the copy: the host copy of one layer gets the next layer's
    token). Found by this checker's state machine."""
    assert _recompute_step(monkeypatch).violations == []
    # negative control: the compute stream no longer waits on the previous layer's write-back
    from sglang_ext.dataplane.layer_pipeline import LayerPipeline

    real = LayerPipeline.begin_layer

    def begin_layer(self, layer):  # noqa: ANN001, ANN202
        self._written_back = None
        real(self, layer)

    monkeypatch.setattr(LayerPipeline, "begin_layer", begin_layer)
    violations = _recompute_step(monkeypatch).violations
    assert any("write by compute" in v and "after a read by stream" in v for v in violations), violations[:3]


class _Simulated:
    """A :mod:`test_core_stateful` machine on the simulated CUDA engine (its copies on the kernels
    or the copy engines, its queries answered by one of the three schedules): every rule runs
    traced and no access may be unordered (besides the machine's own KV and accounting checks)."""

    def _simulate(self, budget: int | None, seed: int, fast: bool, queries: str, dma: bool, page_size: int = 2,
                  paged_reads: bool = False) -> None:
        self.patches = pytest.MonkeyPatch()
        self.sim = install(self.patches, queries, dma)
        core = make_core(budget, pages=stateful.BIG, page_size=page_size)
        track_core(self.sim, core)
        self.tracing = self.sim.tracer()
        self.tracing.__enter__()
        self.driver = CoreDriver(core, seed=seed, fast_decode=fast, paged_reads=paged_reads)

    @invariant()
    def ordered(self) -> None:
        if hasattr(self, "sim"):
            SIMULATED["accesses"] += self.sim.accesses
            self.sim.accesses = 0
            assert self.sim.violations == [], self.sim.violations[:5]

    def teardown(self) -> None:
        SIMULATED["runs"] += 1
        if hasattr(self, "tracing"):
            self.tracing.__exit__(None, None, None)
            self.patches.undo()
        super().teardown()  # type: ignore[misc]


SIMULATED = {"accesses": 0, "runs": 0}


class SimulatedCoreMachine(_Simulated, stateful.CoreMachine):
    @initialize(budget=st.sampled_from([None, 3 * stateful.BIG - 9, stateful.BIG + 6, stateful.BIG, 12, 4]),
                seed=st.integers(0, 2**16), fast=st.booleans(), queries=st.sampled_from([NEVER, RINGS, ALWAYS]),
                dma=st.booleans())
    def setup(self, budget: int | None, seed: int, fast: bool, queries: str, dma: bool) -> None:
        self._simulate(budget, seed, fast, queries, dma)


class SimulatedPagedReadsMachine(_Simulated, stateful.PagedReadsMachine):
    @initialize(budget=st.sampled_from([3 * stateful.BIG - 9, 2 * stateful.BIG, stateful.BIG + 6, stateful.BIG, 12]),
                seed=st.integers(0, 2**16), queries=st.sampled_from([NEVER, RINGS, ALWAYS]), dma=st.booleans())
    def setup(self, budget: int, seed: int, queries: str, dma: bool) -> None:  # type: ignore[override]
        self._simulate(budget, seed, True, queries, dma, page_size=4, paged_reads=True)


TestSimulatedCore = SimulatedCoreMachine.TestCase
TestSimulatedCore.settings = settings(max_examples=60, stateful_step_count=40, deadline=None, derandomize=True,
                                      database=None)
TestSimulatedPagedReads = SimulatedPagedReadsMachine.TestCase
TestSimulatedPagedReads.settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                                            derandomize=True, database=None)


def test_the_simulated_machines_checked_accesses():
    """The two machines above ran traced (runs after them in file order; skipped when they were
    not selected)."""
    if not SIMULATED["runs"]:
        pytest.skip("the simulated machines did not run in this session")
    assert SIMULATED["accesses"] >= 5000, SIMULATED



def _steady_overlap(monkeypatch: pytest.MonkeyPatch, patch: Callable[[pytest.MonkeyPatch, StreamOrder], None]
                    | None = None) -> tuple[StreamOrder, CoreDriver, list[bool], list[bool]]:
    """The identity layout read through page tables (FlashInfer's and Triton's), its steady decode
    steps skipping every per-layer call as the adapter does, under the overlap loop's streams:
    each forward on the forward stream; plan installs (offloads and onloads, their index lists
    uploaded on the current stream) on the schedule stream between forwards, which waits for the
    forward stream after each launch (SGLang's WAR barrier). Returns, after each install, whether
    the schedule stream was still current, and, after each forward, whether the engine had
    forgotten the forward's stream."""
    current_after: list[bool] = []
    forgotten: list[bool] = []
    with monkeypatch.context() as mp:
        sim = install(mp, RINGS)
        if patch is not None:
            patch(mp, sim)
        core = make_core(None, pages=stateful.BIG)
        track_core(sim, core)
        driver = CoreDriver(core, seed=2, fast_decode=True, paged_reads=True)
        schedule = _on_overlap_streams(sim, driver, True,
                                       after=lambda: forgotten.append(core.store.engine._compute is None))
        with sim.tracer():
            for rid in ("a", "b"):
                driver.add(rid)
                assert driver.step([(rid, 3)])
            for i in range(8):  # steady steps (all resident), a plan moving layers out, its steps, all back
                for placement in ([i % 2 == 0, True, i % 3 != 0], [True] * LAYERS):
                    for _ in range(2):
                        assert driver.step([("a", 1), ("b", 1)])
                    driver.want("a", placement)
                    driver.want("b", placement[::-1])
                    current_after.append(sim.current is schedule)
            driver.check_at_rest()
        assert driver.steady_steps >= 8 and core.store.engine.stats.d2h_launches >= 5
    return sim, driver, current_after, forgotten


def _compute_never_forgotten(mp: pytest.MonkeyPatch, sim: StreamOrder) -> None:
    mp.setattr(te.CudaTransferEngine, "end_compute", lambda self: None)


def _launch_on_the_remembered_stream(mp: pytest.MonkeyPatch, sim: StreamOrder) -> None:
    """The launch before the fix: the remembered compute stream taken for the current one (its
    event alone waited for, and left current afterwards)."""
    _compute_never_forgotten(mp, sim)
    real = te.CudaTransferEngine._on_stream

    def on_stream(self, kind, wait, copy, keep, nbytes=0):  # noqa: ANN001, ANN202
        if self._compute is not None:
            sim.set_stream(self._compute)
        return real(self, kind, wait, copy, keep, nbytes)

    mp.setattr(te.CudaTransferEngine, "_on_stream", on_stream)


def test_plans_after_steady_identity_steps_copy_on_the_schedule_streams_order(monkeypatch):
    """Scenario (a review's finding, GPU-only): a steady identity step's layers skip every
    per-layer call, the last layer's exit (which ends the step) included; a plan installed next,
    on the schedule stream, uploads its index lists there and launches its copies. The step
    forgets its stream when it begins, and a launch follows the current stream's uploads and
    leaves it current even when the engine still remembers another stream (the second run: it
    never forgets). The control, the launch as it was: copies read index lists not ordered after
    their upload, and the forward stream is left current for SGLang's schedule work (which
    serialises the overlap from then on). KV exact at every step and at rest."""
    sim, _, current_after, forgotten = _steady_overlap(monkeypatch)
    assert sim.violations == [] and all(current_after) and all(forgotten), (sim.violations[:3], current_after)
    sim, _, current_after, forgotten = _steady_overlap(monkeypatch, _compute_never_forgotten)
    assert sim.violations == [] and all(current_after) and not any(forgotten[2:]), sim.violations[:3]
    sim, _, current_after, _ = _steady_overlap(monkeypatch, _launch_on_the_remembered_stream)
    assert any(v.startswith("read by stream3 (aten.sum") and "after a write by compute" in v
               for v in sim.violations), sim.violations[:3]
    assert not all(current_after)
