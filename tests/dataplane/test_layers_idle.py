"""``LayeredKVCore.layers_idle``: a step whose layers fetch, write back and park nothing lets the
served adapter skip ``enter_layer`` and every ``exit_layer`` but the last (the per-layer calls of
an all-resident paged step: ~0.3 ms of a batch-32 step's host time on an H200's host). The
driver skips them as served (``CoreDriver.skip_idle``) and checks every live token's K/V against
its shadow inside every layer; the stateful paged-reads machine does the same over hundreds of
idle steps (``test_core_stateful.py``). Negative controls: skipping them on every step, staged
ones included, or counting a step that only fetches as idle, loses KV and the same checks fail;
skipping every ``enter_layer`` (lost only on a GPU: its waits are stream waits) is caught on
the simulated CUDA streams."""

from __future__ import annotations

import pytest

from tests.dataplane.core_driver import CoreDriver, make_core, offload_scenario


def _paged_driver() -> CoreDriver:
    core = make_core(40, pages=24, page_size=4)
    d = CoreDriver(core, seed=21, fast_decode=True, paged_reads=True)
    d.add("a")
    d.add("b")
    assert d.step([("a", 6), ("b", 2)])
    return d


def test_resident_paged_steps_are_idle_and_staged_ones_are_not():
    d = _paged_driver()
    core = d.core
    seen: list[tuple[bool, int, int]] = []
    d.on_layer = lambda layer: seen.append((core.layers_idle, len(core.tables.fetches),
                                            sum(w is not None for w in core.tables.writebacks)))
    for _ in range(6):  # all resident: nothing to fetch, write back or park
        assert d.step([("a", 1), ("b", 1)])
    assert seen and all(idle and not f and not w for idle, f, w in seen), seen
    assert d.idle_steps >= 6
    seen.clear()
    d.want("a", [True, False, True])  # layer 1 of a on host: every step fetches it and parks its token
    idle_before = d.idle_steps
    for _ in range(3):
        assert d.step([("a", 1), ("b", 1)])
    assert seen and not any(idle for idle, _, _ in seen), seen
    assert d.idle_steps == idle_before  # the staged steps made every per-layer call
    d.check_at_rest()


def test_the_identity_layout_in_place_is_idle_and_an_overflow_is_not():
    core = make_core(None, pages=24)
    d = CoreDriver(core, seed=22)
    d.add("a")
    assert d.step([("a", 5)])
    assert core.layers_idle  # in place: no pipeline, nothing per layer
    tiny = make_core(4, pages=24)  # fewer device pages than one request's staging
    t = CoreDriver(tiny, seed=23)
    t.add("a")
    t.want("a", [True, False, False])
    flags = []
    t.on_layer = lambda layer: flags.append((tiny.overflow, tiny.layers_idle))
    assert t.step([("a", 9)])
    assert flags and all(over for over, _ in flags), flags  # served at rest
    assert not any(idle for _, idle in flags)
    t.check_at_rest()


def test_negative_control_skipping_a_staged_steps_calls_loses_kv():
    """The offloading scenario with the per-layer calls skipped on every step: the staged steps'
    fetches and write-backs never run and the shadow checks fail. (Skipped only when idle, the
    same scenario passes: ``test_the_scenario_passes_skipping_only_idle_steps``.)"""
    d = CoreDriver(make_core(33 + 6), seed=1, paged_reads=True)
    d.skip_idle = "always"
    with pytest.raises(AssertionError) as failed:
        offload_scenario(d)
    rid, layer = failed.value.args[0]  # the shadow check inside a layer: (request, layer)
    assert rid in ("a", "b") and 0 <= layer < d.core.layers


def test_the_scenario_passes_skipping_only_idle_steps():
    d = CoreDriver(make_core(3 * 33 - 9), seed=1, paged_reads=True)  # paged, room for both resident
    assert d.skip_idle is True  # the paged-reads driver skips as served
    offload_scenario(d)
    for rid in ("a", "b"):  # then all resident: idle steps on the same pool
        d.want(rid, [True] * d.core.layers)
    before = d.idle_steps
    for _ in range(6):
        assert d.step([("a", 1), ("b", 1)])
    assert d.idle_steps - before >= 3
    d.check_at_rest()


def _fetch_only(d: CoreDriver) -> list[bool]:
    """Steps that fetch and neither write back nor park: a's first two pages on device in no
    layer (an uncached prefix, fetched into staging every step; nothing new lands there)."""
    core = d.core
    seen: list[tuple[bool, int, int, bool]] = []
    d.on_layer = lambda layer: seen.append((core.layers_idle, len(core.tables.fetches),
                                            sum(w is not None for w in core.tables.writebacks),
                                            core.tables.token_writeback is not None))
    d.want("a", [True] * core.layers, uncached=2)
    for _ in range(3):
        assert d.step([("a", 1), ("b", 1)])
    assert seen and all(f and not w and not parked for _, f, w, parked in seen), seen  # fetch-only indeed
    return [idle for idle, *_ in seen]


def test_a_step_that_only_fetches_is_not_idle():
    d = _paged_driver()
    assert not any(_fetch_only(d))
    d.check_at_rest()


def test_negative_control_idle_ignoring_fetches_loses_kv(monkeypatch):
    """``LayerPipeline.idle`` without its fetch clause: the fetch-only steps skip the layers' fetch
    launches and the shadow check inside the layer fails."""
    from sglang_ext.dataplane.layer_pipeline import LayerPipeline

    real = LayerPipeline.begin_step

    def begin_step(self, tables):  # noqa: ANN001, ANN202
        real(self, tables)
        self.idle = tables.token_writeback is None and all(w is None for w in tables.writebacks)

    monkeypatch.setattr(LayerPipeline, "begin_step", begin_step)
    d = _paged_driver()
    with pytest.raises(AssertionError) as failed:
        _fetch_only(d)
    rid, layer = failed.value.args[0]
    assert rid == "a" and layer > 0  # a layer whose fetch was never launched


def test_skipped_waits_are_caught_on_the_simulated_streams(monkeypatch):
    """On the CPU a skipped ``enter_layer`` loses nothing (its waits are stream waits); on the
    simulated CUDA streams (``stream_order.py``) the served skip keeps every access ordered,
    while skipping every ``enter_layer`` (control) lets layers read staging before its fetch."""
    from tests.dataplane.cuda_simulation import install, track_core

    def run(skip: object) -> tuple[list[str], int]:
        with monkeypatch.context() as mp:
            sim = install(mp)
            core = make_core(40, pages=24, page_size=4)
            track_core(sim, core)
            d = CoreDriver(core, seed=21, fast_decode=True, paged_reads=True)
            d.skip_idle = skip
            with sim.tracer():
                d.add("a")
                d.add("b")
                assert d.step([("a", 6), ("b", 2)])
                for _ in range(3):
                    assert d.step([("a", 1), ("b", 1)])
                d.want("a", [True, False, True])  # staged: fetches, parks
                for _ in range(3):
                    assert d.step([("a", 1), ("b", 1)])
            return sim.violations, d.idle_steps

    violations, idle = run(True)
    assert violations == [] and idle >= 3
    violations, _ = run("enter")
    assert violations, "skipping the layers' waits went unnoticed"
