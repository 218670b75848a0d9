"""GPU discipline of the served core, enforced on CPU.

Inside a layer the core may only wait on streams, take table rows and launch kernels: no op
that makes the host wait for a device (``item``/``bool`` of a tensor, ``nonzero``, ``unique``,
``masked_select``, ``repeat_interleave`` without ``output_size``, pageable D2H), and the number
of ops per layer must not depend on the batch or the pool size. The attention of a layer waits
on that layer's fetch events; a request's next fetch waits on the write-back of the layer that
used its staging slot (the placement model's timeline).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from sglang_ext.dataplane.transfer_engine import CpuEvent
from sglang_ext.testing.op_audit import OpAudit, audit_core
from tests.dataplane.core_driver import LAYERS, CoreDriver, make_core, two_offloading

PLACEMENT = [True, False, False]


def _prefilled(d: CoreDriver, batch: int, tokens: int, placement: list[bool] | None = None) -> list[str]:
    """``batch`` requests prefilled one at a time with ``tokens`` each (then given ``placement``)."""
    rids = [f"r{i}" for i in range(batch)]
    for rid in rids:
        d.add(rid)
        assert d.step([(rid, tokens)])
    for rid in rids if placement is not None else ():
        d.want(rid, placement)
    return rids


def _run(budget_extra: int | None, pages: int, batch: int) -> tuple[OpAudit, CoreDriver]:
    """Prefill ``batch`` requests, offload layers 1 and 2 of each, then one audited decode step
    and one audited extend step."""
    core = make_core(None if budget_extra is None else pages + budget_extra, pages=pages)
    d = CoreDriver(core, seed=batch)
    rids = _prefilled(d, batch, 3, PLACEMENT)
    audit = OpAudit()
    audit_core(core, audit)
    with audit:
        assert d.step([(rid, 1) for rid in rids])
    decode_ops = {layer: Counter(ops) for layer, ops in audit.ops.items()}
    with audit:
        assert d.step([(rid, 2) for rid in rids])  # an extend step of every request
    d.check_at_rest()
    audit.decode_ops = decode_ops  # type: ignore[attr-defined]
    return audit, d


@pytest.mark.parametrize("budget_extra", [None, 40], ids=["identity", "staged"])
def test_no_host_sync_inside_a_layer_and_constant_ops_per_layer(budget_extra):
    """Decode and extend steps with offloaded layers: zero sync ops inside any layer, and the
    per-layer op counts of a decode step are the same for batch 1, 4, 8 and pools of 33 and 257
    pages."""
    seen = {}
    for pages in (33, 257):
        for batch in (1, 4, 8):
            audit, driver = _run(budget_extra, pages, batch)
            assert not driver.core.overflow
            assert audit.violations == [], audit.violations
            assert sorted(audit.decode_ops) == list(range(LAYERS))
            seen[(pages, batch)] = audit.decode_ops
    first = next(iter(seen.values()))
    for key, ops in seen.items():
        assert ops == first, (key, ops, first)


def test_paged_reads_and_advanced_steps_keep_layers_sync_free_and_constant():
    """The layout SGLang's paged decode backends read (page tables and CSR, no token tables),
    pages of 4 tokens, every request resident: steady decode steps, advanced from the last
    step's tables or built (a page opens), make no sync op inside a layer, and every layer of
    every step runs the same ops for batch 1, 4, 8 and pools of 33 and 257 pages."""
    seen = {}
    for pages in (33, 257):
        for batch in (1, 4, 8):
            core = make_core(min(3 * pages - 9, pages + 80), pages=pages, page_size=4)  # holds 8 x 3 pages
            d = CoreDriver(core, seed=batch, fast_decode=True, paged_reads=True)
            rids = _prefilled(d, batch, 5)
            assert d.step([(rid, 1) for rid in rids])  # lens 6: the next three steps open no page
            audit = OpAudit()
            audit_core(core, audit)
            before = core.advanced_decode_steps
            for _ in range(4):  # lens 7, 8 advance; 9 opens a page and builds; 10 advances
                with audit:
                    assert d.step([(rid, 1) for rid in rids])
            assert core.advanced_decode_steps - before == 3
            assert audit.violations == [], audit.violations
            per_layer = {layer: Counter(ops) for layer, ops in audit.ops.items()}
            assert sorted(per_layer) == list(range(LAYERS))
            assert all(ops == per_layer[0] for ops in per_layer.values()), per_layer
            d.check_at_rest()
            seen[(pages, batch)] = per_layer[0]
    first = next(iter(seen.values()))
    assert first and all(ops == first for ops in seen.values()), seen


def test_placed_steps_advanced_with_their_staging_keep_layers_sync_free_and_constant():
    """A placed batch (layers 1 and 2 of every request on the host) read through page tables,
    pages of 4 tokens: its steady decode steps advance the last step's tables with the same
    staging (``advanced_staged``), open a page or not, stage, fetch and write back, and make no
    sync op inside a layer; each layer runs the same ops for batch 1, 4, 8 and pools of 33 and
    257 pages."""
    seen = {}
    for pages in (33, 257):
        for batch in (1, 4, 8):
            core = make_core(min(3 * pages - 9, pages + 80), pages=pages, page_size=4)
            d = CoreDriver(core, seed=batch, fast_decode=True, paged_reads=True)
            rids = _prefilled(d, batch, 5, PLACEMENT)
            assert d.step([(rid, 1) for rid in rids])  # the move builds this step (lens 6)
            audit = OpAudit()
            audit_core(core, audit)
            before, fetched = core.staged_advances, core.pipeline.fetched_layer_pages
            for _ in range(4):  # lens 7, 8 advance; 9 opens a page and advances with it; 10 advances
                with audit:
                    assert d.step([(rid, 1) for rid in rids])
            assert core.staged_advances - before == 4
            assert core.pipeline.fetched_layer_pages - fetched >= 4 * 2 * batch  # they staged and fetched
            assert audit.violations == [], audit.violations
            per_layer = {layer: Counter(ops) for layer, ops in audit.ops.items()}
            assert sorted(per_layer) == list(range(LAYERS))
            d.check_at_rest()
            seen[(pages, batch)] = per_layer
    first = next(iter(seen.values()))
    assert all(ops == first for ops in seen.values()), seen


def test_the_audit_flags_host_syncs():
    """Negative control: item(), bool(), nonzero, unique and repeat_interleave without
    output_size inside a scope are flagged; the same ops outside any scope are not."""
    audit = OpAudit()
    x = torch.tensor([0, 2, 1])
    with audit:
        x.nonzero()  # outside a scope
        with audit.scope(0):
            int(x[1])
            bool(x[0])
            x.nonzero()
            torch.unique(x)
            x.repeat_interleave(x)
            x.repeat_interleave(x, output_size=3)  # fine: the size is known on the host
            x + 1
    flagged = [name for _, name in audit.violations]
    assert "aten._local_scalar_dense.default" in flagged
    assert "aten.nonzero.default" in flagged
    assert any("unique" in name for name in flagged)
    assert sum("repeat_interleave" in name for name in flagged) == 1
    assert "aten.add.Tensor" in audit.ops[0] and all(scope == 0 for scope, _ in audit.violations)


def test_a_sync_in_the_served_path_would_be_caught(monkeypatch):
    """Negative control on the real path: a host read slipped into ``exit_layer`` is flagged."""
    from sglang_ext.dataplane import layer_pipeline

    real = layer_pipeline.LayerPipeline.end_layer

    def end_layer_with_a_sync(self, layer):  # noqa: ANN001
        if self.tables is not None:
            int(self.tables.tab[layer][0])
        return real(self, layer)

    monkeypatch.setattr(layer_pipeline.LayerPipeline, "end_layer", end_layer_with_a_sync)
    audit, _ = _run(40, 33, 2)
    assert audit.violations and all(name == "aten._local_scalar_dense.default" for _, name in audit.violations)


def test_the_audit_flags_host_reads_that_a_cpu_host_never_dispatches():
    """Negative control: tolist, numpy, cpu, item and NumPy conversion of a tensor inside a scope
    are flagged by name (on a CPU host none of them dispatches a device-to-host copy); outside a
    scope they are not, and after the audit the methods are torch's own again."""
    import numpy as np

    real = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu", "item", "__array__")}
    audit = OpAudit()
    x = torch.tensor([0, 2, 1])
    with audit:
        x.tolist()  # outside a scope
        with audit.scope(5):
            x.tolist()
            x.numpy()
            x.cpu()
            x[0].item()
            np.asarray(x)
    flagged = {name for _, name in audit.violations}  # item also dispatches _local_scalar_dense
    assert flagged - {"aten._local_scalar_dense.default"} == {
        "Tensor.__array__", "Tensor.cpu", "Tensor.item", "Tensor.numpy", "Tensor.tolist"}
    assert all(scope == 5 for scope, _ in audit.violations)
    assert all(getattr(torch.Tensor, name) is fn for name, fn in real.items())
    again = OpAudit()  # re-entered (per layer, as the served audit does): patched until the outer exit
    with again:
        with again:
            pass
        with again.scope(1):
            x.tolist()
    assert again.violations == [(1, "Tensor.tolist")]
    with pytest.raises(RuntimeError), again:  # an exception inside: restored all the same
        raise RuntimeError
    assert all(getattr(torch.Tensor, name) is fn for name, fn in real.items())


def test_a_host_read_in_the_served_path_would_be_caught(monkeypatch):
    """Negative control on the real path: a ``tolist`` slipped into ``exit_layer`` is flagged."""
    from sglang_ext.dataplane import layer_pipeline

    real = layer_pipeline.LayerPipeline.end_layer

    def end_layer_with_a_read(self, layer):  # noqa: ANN001
        if self.tables is not None:
            self.tables.tab[layer].tolist()
        return real(self, layer)

    monkeypatch.setattr(layer_pipeline.LayerPipeline, "end_layer", end_layer_with_a_read)
    audit, _ = _run(40, 33, 2)
    assert audit.violations and all(name == "Tensor.tolist" for _, name in audit.violations)


def test_attention_waits_on_its_layers_fetch_events_and_one_write_back_ends_the_step():
    """Staged decode step, layers 0 and 2 offloaded: layer 0's fetch starts with the step, layer
    2's when layer 0 ends (same staging slot) and waits on no write-back (the new tokens are
    parked, not written back from the slot); ONE D2H, of token rows, after layer 2, the last
    offloaded layer; entering a layer waits on exactly the events of this step's launches that
    fetched it."""
    core = make_core(33 + 20)
    engine = core.store.engine
    launches: list[tuple[str, int, tuple, int]] = []
    real_launch = engine._launch
    at_layer = [-1]

    def record(kind, src, dst, src_idx, dst_idx, wait, host_idx, keep=()):  # noqa: ANN001
        event = real_launch(kind, src, dst, src_idx, dst_idx, wait, host_idx, keep)
        launches.append((kind, event.seq, tuple(wait), at_layer[0]))
        return event

    engine._launch = record
    d = two_offloading(core)
    entered: dict[int, list] = {}
    real_enter, real_exit = core.enter_layer, core.exit_layer

    def enter(layer: int) -> None:
        at_layer[0] = layer
        expected = list(core.pipeline._events[layer])
        real_enter(layer)
        entered[layer] = (expected, list(engine.waited[-len(expected):]) if expected else [])

    def exit_(layer: int) -> None:
        at_layer[0] = layer
        real_exit(layer)

    core.enter_layer, core.exit_layer = enter, exit_
    d.step([("a", 1), ("b", 1)])  # a staged step before: its events are not the next one's
    launches.clear()
    rows_before = engine.stats.d2h_rows
    d.step([("a", 1), ("b", 1)])
    expected0, waited0 = entered[0]
    assert expected0 and waited0 == expected0 and all(isinstance(e, CpuEvent) and e.kind == "h2d" for e in expected0)
    expected2, waited2 = entered[2]
    assert expected2 and waited2 == expected2
    this_step = {seq for _, seq, _, _ in launches}  # no earlier step's event left in a layer's list
    assert all(e.seq in this_step for e in expected0 + expected2), (expected0, expected2)
    assert entered[1][0] == []  # a resident layer waits on nothing
    fetch2 = [launch for launch in launches if launch[0] == "h2d" and launch[3] == 0]
    assert fetch2 and all(wait == () for _, _, wait, _ in fetch2), "layer 2's fetch waits on no write-back"
    d2h = [launch for launch in launches if launch[0] == "d2h"]
    assert [layer for *_, layer in d2h] == [2], "one write-back, after the last offloaded layer"
    assert engine.stats.d2h_rows - rows_before == 2 * 2 * 2  # 2 requests x 2 layers x (K, V)
    d.check_at_rest()
