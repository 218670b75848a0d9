"""Stateful test of the served core: random lifecycles over 1,000+ forwards keep KV exact.

A hypothesis state machine drives :class:`LayeredKVCore` through batched prefills and decodes,
plan changes (random per-layer placements), recompute steps (an uncached prefix recomputed at the
lowest layers, fetched above), pauses and resumes, finishes and prefix-cache hits,
on the identity layout, budgets that stage comfortably, and budgets so small that steps
overflow. Inside every layer the served read path must return the shadow K/V; between forwards
every live token reads back bit-exact, the map and allocator agree (no leak, no double use),
the device never holds more than the budget, and staging is reserved for every host-only
layer-page of each staged step.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.dataplane.core_driver import (
    KV_MISMATCH,
    LAYERS,
    PAGES,
    CoreDriver,
    make_core,
    offload_scenario,
)

RIDS = ("a", "b", "c", "d")
BIG = 2 * PAGES - 1
"""Logical pages of the machine's core (65): room for long lifecycles."""
STEPS = {"total": 0, "recompute_rows": 0, "fast": 0, "advanced": 0, "opened": 0, "resident_builds": 0, "staged": 0, "idle": 0,
         "turnovers": 0, "rewrites": 0}


class CoreMachine(RuleBasedStateMachine):
    """Random lifecycles of up to four requests over one core."""

    @initialize(budget=st.sampled_from([None, None, 3 * BIG - 9, BIG + 6, BIG, 12, 4]),
                seed=st.integers(0, 2**16), fast=st.booleans())
    def setup(self, budget: int | None, seed: int, fast: bool) -> None:
        self.driver = CoreDriver(make_core(budget, pages=BIG), seed=seed, fast_decode=fast)

    @rule(rid=st.sampled_from(RIDS), n=st.integers(1, 7), share=st.sampled_from((None, *RIDS)),
          share_pages=st.integers(0, 3))
    def prefill(self, rid: str, n: int, share: str | None, share_pages: int) -> None:
        d = self.driver
        if rid not in d.slots:
            d.add(rid, share_from=share if share != rid else None, share_pages=share_pages)
        d.step([(rid, n)])

    @precondition(lambda self: any(r not in self.driver.paused for r in self.driver.slots))
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        running = sorted(r for r in self.driver.slots if r not in self.driver.paused)
        for _ in range(data.draw(st.integers(1, 3))):
            rids = data.draw(st.lists(st.sampled_from(running), min_size=1, max_size=len(running), unique=True))
            for _ in range(data.draw(st.integers(1, 3))):  # a steady batch decodes several steps
                self.driver.step([(rid, 1) for rid in rids])

    @precondition(lambda self: any(r not in self.driver.paused for r in self.driver.slots))
    @rule(steps=st.integers(2, 6))
    def steady(self, steps: int) -> None:
        """A plan putting every running request fully on the device, then a steady stretch of
        decode steps of the same batch (the served fast path when the layout is the identity)."""
        d = self.driver
        running = sorted(r for r in d.slots if r not in d.paused)
        for rid in running:
            d.recompute.pop(rid, None)
            d.want(rid, [True] * LAYERS)
        for _ in range(steps):
            d.step([(rid, 1) for rid in running])

    @rule(rid=st.sampled_from(RIDS), layers=st.lists(st.booleans(), min_size=LAYERS, max_size=LAYERS))
    def place(self, rid: str, layers: list[bool]) -> None:
        if rid not in self.driver.paused:
            self.driver.want(rid, layers)

    @rule(rid=st.sampled_from(RIDS), u=st.integers(1, 4), k=st.integers(0, LAYERS),
          layers=st.lists(st.booleans(), min_size=LAYERS, max_size=LAYERS))
    def recompute(self, rid: str, u: int, k: int, layers: list[bool]) -> None:
        """eLLM's uncached prefix (docs/recompute.md): the first ``u`` pages leave the device;
        its decode steps recompute them at layers ``< k`` and fetch them above."""
        if rid in self.driver.slots and rid not in self.driver.paused:
            self.driver.recompute[rid] = (u, k)
            self.driver.want(rid, layers, uncached=u)

    @rule(rid=st.sampled_from(RIDS))
    def pause(self, rid: str) -> None:
        self.driver.want(rid, [True] * LAYERS, paused=True)

    @precondition(lambda self: bool(self.driver.paused))
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.driver.paused)))
        self.driver.want(rid, data.draw(st.lists(st.booleans(), min_size=LAYERS, max_size=LAYERS)))

    @rule(rid=st.sampled_from(RIDS))
    def finish(self, rid: str) -> None:
        self.driver.finish(rid)

    @rule(rid=st.sampled_from(RIDS), src=st.sampled_from(RIDS))
    def rewrite(self, rid: str, src: str) -> None:
        """SGLang's prefix dedupe: ``rid``'s first page replaced by ``src``'s, its own freed."""
        self.driver.rewrite_prefix(rid, src)

    @invariant()
    def exact_and_accounted(self) -> None:
        if hasattr(self, "driver"):
            self.driver.check_at_rest()

    def teardown(self) -> None:
        if hasattr(self, "driver"):
            STEPS["total"] += self.driver.steps
            STEPS["recompute_rows"] += self.driver.recompute_rows
            STEPS["fast"] += self.driver.fast_steps
            STEPS["advanced"] += self.driver.core.advanced_decode_steps
            STEPS["opened"] += self.driver.core.opened_advances
            STEPS["resident_builds"] += self.driver.core.resident_builds
            STEPS["staged"] += self.driver.core.staged_advances
            STEPS["idle"] += self.driver.idle_steps
            STEPS["turnovers"] += self.driver.core.continuity.turnovers
            STEPS["rewrites"] += self.driver.rewrites


TestCore = CoreMachine.TestCase
TestCore.settings = settings(max_examples=170, stateful_step_count=40, deadline=None, derandomize=True,
                             database=None)  # the same examples in every checkout (no replayed failures)


class IdentityFastMachine(CoreMachine):
    """The same lifecycles on the identity layout with the served steady-decode fast path always
    tried (journalled bookkeeping): its coverage does not hang on the budget draws above, which
    hypothesis makes differently depending on what else the run collected (a full run once drew
    no identity budget at all)."""

    @initialize(seed=st.integers(0, 2**16))
    def setup(self, seed: int) -> None:  # type: ignore[override]
        self.driver = CoreDriver(make_core(None, pages=BIG), seed=seed, fast_decode=True)


TestIdentityFast = IdentityFastMachine.TestCase
TestIdentityFast.settings = settings(max_examples=40, stateful_step_count=40, deadline=None, derandomize=True,
                                     database=None)


class PagedReadsMachine(CoreMachine):
    """The same lifecycles in the paged layout read as SGLang's paged decode backends read it
    (FlashInfer, Triton: page tables and CSR, no token tables), with pages of 4 tokens and the
    steady-decode path always tried: steps whose map did not change but for the pages they open
    run on the last step's tables advanced by one token, staged ones with their staging again
    (:meth:`PagedDecodeStep.advance`)."""

    @initialize(budget=st.sampled_from([3 * BIG - 9, 2 * BIG, BIG + 6, BIG, 12]), seed=st.integers(0, 2**16))
    def setup(self, budget: int, seed: int) -> None:  # type: ignore[override]
        core = make_core(budget, pages=BIG, page_size=4)
        self.driver = CoreDriver(core, seed=seed, fast_decode=True, paged_reads=True)


TestPagedReads = PagedReadsMachine.TestCase
TestPagedReads.settings = settings(max_examples=40, stateful_step_count=40, deadline=None, derandomize=True,
                                   database=None)


def test_the_machine_ran_over_a_thousand_forwards():
    """The state machine above drove at least 1,000 forwards (runs after it in file order), some
    of them recomputing a prefix, some on the steady-decode fast path (journalled bookkeeping,
    applied when the checks or the next change read residency)."""
    assert STEPS["total"] >= 1000, STEPS  # derandomized: the same draws every run
    assert STEPS["recompute_rows"] > 0, STEPS
    assert STEPS["fast"] >= 50, STEPS
    assert STEPS["advanced"] >= 20, STEPS  # the paged-reads machine's advanced steps
    assert STEPS["opened"] >= 20, STEPS  # ... and those that opened pages (advanced_opening)
    assert STEPS["resident_builds"] >= 20, STEPS  # and its page-opening steps built knowing the batch resident
    assert STEPS["staged"] >= 5, STEPS  # and its placed batches' steps advanced with their staging (10-52, by test order)
    assert STEPS["idle"] >= 50, STEPS  # and its steps whose layers skipped enter / exit as served (layers_idle)
    assert STEPS["turnovers"] >= 50, STEPS  # decode steps whose batch changed, continued (DecodeContinuity)
    assert STEPS["rewrites"] >= 20, STEPS  # rows rewritten by SGLang's prefix dedupe (the frees cut them)
    print(f"\nstateful core: {STEPS}")


@pytest.mark.parametrize("broken", ["no_launch", "no_park"])
def test_the_scenario_fails_when_parked_tokens_do_not_reach_host(monkeypatch, broken):
    """Negative controls of a decode step's token write-back (``TokenWriteback``): the same checks
    catch a pipeline that never issues the one D2H of the parked tokens, and a write that does
    not park them (the D2H then writes stale rows)."""
    from sglang_ext.dataplane.token_writeback import TokenWriteback
    from sglang_ext.dataplane.transfer_engine import TransferEngine

    parks = []
    real_park = TokenWriteback.park
    monkeypatch.setattr(TokenWriteback, "park", lambda self, *a: (parks.append(1), real_park(self, *a)))
    offload_scenario(CoreDriver(make_core(PAGES + 6), seed=1))
    assert parks, "the scenario's decode steps park tokens"
    if broken == "no_launch":
        monkeypatch.setattr(TransferEngine, "d2h_rows", lambda self, *a, **k: None)
    else:
        monkeypatch.setattr(TokenWriteback, "park", lambda self, *a: None)
    with pytest.raises(AssertionError, match=KV_MISMATCH):
        offload_scenario(CoreDriver(make_core(PAGES + 6), seed=1))


def test_the_scenario_passes_and_fails_when_write_back_is_skipped(monkeypatch):
    """Negative control: the same checks catch a pipeline that drops the write-back of staged
    new tokens (the new KV of offloaded layers would never reach host memory)."""
    offload_scenario(CoreDriver(make_core(PAGES + 6), seed=1))
    from sglang_ext.dataplane.paged_step_tables import PagedStepTables

    real = PagedStepTables.__init__  # the paged layout's tables (the scenario's budget is paged)

    def no_writeback(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        real(self, *args, **kwargs)
        if self.reserved:
            self.writebacks = [None] * len(self.writebacks)

    monkeypatch.setattr(PagedStepTables, "__init__", no_writeback)
    with pytest.raises(AssertionError, match=KV_MISMATCH):
        offload_scenario(CoreDriver(make_core(PAGES + 6), seed=1))
