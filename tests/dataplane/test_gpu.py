"""The served core on a GPU: CUDA transfer engine (two side streams, Triton over pinned host
memory, per-layer events), the same lifecycle checks as on CPU, and FlashInfer paged decode over
the step's tables (bf16 tolerance)."""

import pytest
import torch

from sglang_ext.dataplane import dense_attention
from sglang_ext.dataplane.results import LayerView
from tests.dataplane.core_driver import (
    HEADS,
    LAYERS,
    PAGES,
    CoreDriver,
    make_core,
    offload_scenario,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


FLASHINFER_DIM = 64
"""FlashInfer's decode kernels take head dims of 64, 128 or 256 (the toy DIM fails to build)."""


@pytest.mark.parametrize("budget", [None, PAGES + 6, 4])
def test_cuda_lifecycle_bit_exact(budget):
    """Prefills, decodes with offloaded layers, a pause and a resume on CUDA: every layer's read
    inside the step and every read at rest equal the shadow bit for bit."""
    core = make_core(budget, device="cuda")
    assert core.store.host.is_pinned()
    offload_scenario(CoreDriver(core, seed=3))


@pytest.mark.parametrize("programs", [1, 8])
def test_cuda_lifecycle_bit_exact_with_capped_copy_launches(programs):
    """The same lifecycle with every Triton copy and fetch launch capped at ``programs``
    persistent programs (``CudaTransferEngine.copy_programs``, gpu-check's overlap sweep)."""
    core = make_core(PAGES + 6, device="cuda")
    core.store.engine.copy_programs = programs
    offload_scenario(CoreDriver(core, seed=3))


def _dma_core(budget: int | None, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN202
    """A CUDA core whose engine copies on the DMA copy engines (probed in a child process first:
    a driver that crashes on the call fails the test, not the run; a driver older than CUDA 12.8
    skips)."""
    from kernels.batched_memcpy import probe_in_subprocess

    why = probe_in_subprocess()
    if why is not None and "needs a CUDA 12.8+ driver" in why:
        pytest.skip(why)
    assert why is None, why
    from sglang_ext.dataplane import cuda_transfer_engine as transfer_engine

    monkeypatch.setattr(transfer_engine, "DMA_MIN_BYTES", 0)  # the toy segments are tiny: DMA all the same
    core = make_core(budget, device="cuda")
    engine = core.store.engine
    assert engine.set_copy_engine("dma"), engine.dma_error
    assert engine.impl == "dma" and engine._pitched is not None, engine.pitched_error
    return core


@pytest.mark.parametrize("pitched", [True, False])
@pytest.mark.parametrize("budget", [PAGES + 6, 4])
def test_cuda_lifecycle_bit_exact_on_the_copy_engines(budget, pitched, monkeypatch):
    """The same lifecycle with every copy on the DMA copy engines (``--kv-copy-engine dma``:
    strided runs as ``cuMemcpy2DAsync`` calls and the rest as one ``cuMemcpyBatchAsync`` per
    launch, fetches listed on the host; ``pitched=False``: the batched memcpy alone, as when the
    2-D copies are refused). Any refusal but an old driver's fails. At a budget of 4 pages the
    batch's staging never fits: every step overflows and is served at rest (no pipeline, so no
    copy-engine launch; the CPU simulation shows the same: gpu-check run 17 on an H200 first ran
    this and found 0 calls there, which the test had wrongly required)."""
    core = _dma_core(budget, monkeypatch)
    engine = core.store.engine
    if not pitched:
        engine._pitched = None
    offload_scenario(CoreDriver(core, seed=3))
    assert engine._dma is not None and engine.impl == "dma", engine.dma_error
    if budget == 4:
        assert core.overflow_steps > 0
        return
    assert core.overflow_steps == 0 and engine._dma.calls > 0
    assert not pitched or engine._pitched.calls > 0


def test_cuda_interleaved_decode_pages_bit_exact_as_free_step_runs(monkeypatch):
    """Decode pages interleave across the batch; with the free-step pass on at toy sizes, the
    fetches and write-backs of 20 more decode steps go partly as 2-D copies at a host step of
    their own (``kernels.pitched_memcpy.plan_runs``, the pitch per run in each driver record):
    every read stays bit-exact (the CPU stream-order checker found 172 such runs here), with
    fetch plans reused across layers (``FetchRunCache``) among them."""
    from kernels import pitched_memcpy

    core = _dma_core(PAGES + 6, monkeypatch)
    found: list[int] = []
    real = pitched_memcpy.free_pitch_runs

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = real(*args, **kwargs)
        found.append(int((out[2] > 1).sum()))
        return out

    monkeypatch.setattr(pitched_memcpy, "free_pitch_runs", counted)
    monkeypatch.setattr(pitched_memcpy, "FREE_PITCH_MIN", 3)
    driver = CoreDriver(core, seed=3)
    offload_scenario(driver)
    for i in range(20):
        driver.want("a", [i % 2 == 0, True, False])
        driver.want("b", [False, i % 3 == 0, True])
        assert driver.step([("a", 1), ("b", 1)])
    driver.check_at_rest()
    assert core.store.engine._pitched is not None, core.store.engine.pitched_error
    assert sum(found) > 0, found
    plans = core.store.engine.fetch_runs  # some fetches took another layer's plan, shifted (11 on the CPU)
    assert plans.reused > 0 and plans.disagreed == 0, (plans.planned, plans.reused, plans.disagreed)


def test_h2d_and_d2h_streams_are_distinct_and_ordered():
    """The CUDA engine uses two side streams; a fetch waiting on a write-back sees its data."""
    core = make_core(PAGES + 6, device="cuda")
    eng = core.store.engine
    assert eng.h2d_stream != eng.d2h_stream
    dev, host = eng.dev, eng.host
    dev[0].fill_(3.0)
    idx = lambda *v: eng.index_tensor(__import__("numpy").asarray(v))  # noqa: E731
    ev = eng.d2h(idx(0), idx(5))
    ev2 = eng.h2d(idx(5), idx(1), wait=[ev])
    ev2.synchronize()
    assert torch.equal(dev[1].cpu(), torch.full_like(dev[1].cpu(), 3.0))
    assert torch.equal(host[5], torch.full_like(host[5], 3.0))


def _flashinfer_checker(core, d: CoreDriver, checked: list[int]):  # noqa: ANN001, ANN202
    """An ``on_layer`` hook: FlashInfer decode of the step's ``tab[l]`` (planned at layer 0 as
    SGLang's layered decode plans: from the host CSR, with the host never waiting for the GPU)
    equals dense attention over the shadow K/V of requests a and b (bf16 tolerance)."""
    flashinfer_attention = pytest.importorskip("sglang_ext.dataplane.flashinfer_attention")
    if not flashinfer_attention.HAVE_FLASHINFER:
        pytest.skip("flashinfer not importable")
    q_heads = 4
    decode = flashinfer_attention.FlashInferLayeredDecode("cuda", max_pages=PAGES)

    def check(layer: int) -> None:
        tables = core.tables
        view = LayerView(layer, core.store.dev[0], core.store.dev[1], tables.kv_indptr, tables.tab[layer],
                         tables.kv_lens, tables.last_page_len, ())
        if layer == 0:
            decode.new_step()
            plan_view = tables.plan_view(view)
            assert plan_view.kv_indptr.device.type == "cpu" and plan_view.kv_indptr.is_pinned()
            torch.cuda.set_sync_debug_mode("error")
            try:
                decode.plan(plan_view, q_heads)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        q = torch.randn((2, q_heads, FLASHINFER_DIM), device="cuda", dtype=torch.bfloat16)
        out = decode.run(q, view)
        for b, rid in enumerate(("a", "b")):
            k = torch.stack([d.shadow[(layer, s)][0] for s in d.slots[rid]]).cuda()
            v = torch.stack([d.shadow[(layer, s)][1] for s in d.slots[rid]]).cuda()
            torch.testing.assert_close(out[b : b + 1], dense_attention(q[b : b + 1], k, v), atol=2e-2, rtol=2e-2)
        checked.append(layer)

    return check


def test_flashinfer_decode_over_the_step_tables_matches_dense():
    """FlashInfer decode with one plan per step over ``tab[l]`` (staged host pages) == dense (bf16)."""
    core = make_core(PAGES + 6, dtype=torch.bfloat16, device="cuda", page_size=16, head_dim=FLASHINFER_DIM)
    d = CoreDriver(core, seed=1)
    results: list[int] = []
    check = _flashinfer_checker(core, d, results)
    d.add("a")
    d.add("b")
    d.step([("a", 40), ("b", 23)])
    d.want("a", [True, False, True])
    d.want("b", [False, True, False])
    d.on_layer = check
    d.step([("a", 1), ("b", 1)])
    assert results == list(range(LAYERS))
    assert HEADS == 2


def test_cuda_advanced_paged_steps_bit_exact():
    """Paged steady decode steps on CUDA read through the page tables and CSR (as FlashInfer and
    the Triton kernel do): resident steps advance the last step's tables on the device (rows and
    lengths + 1; the pages a step opens spliced into the page tables); the step after a placement
    change builds and stages, the placed steps after it advance with their staging (the fetch
    kernel reading the advanced upload's request ids and columns); every read inside a step and
    at rest equals the shadow bit for bit."""
    core = make_core(34, device="cuda", page_size=4, pages=24)
    assert not core.store.identity
    d = CoreDriver(core, seed=9, fast_decode=True, paged_reads=True)
    d.add("a")
    d.add("b")
    d.step([("a", 5), ("b", 3)])
    for _ in range(6):
        d.step([("a", 1), ("b", 1)])
    advanced = core.advanced_decode_steps
    assert advanced > 0 and core.opened_advances > 0  # 2 and 3 on the CPU with these draws
    d.want("a", [True, False, True])
    for _ in range(6):
        d.step([("a", 1), ("b", 1)])
    assert core.advanced_decode_steps == advanced and core.staged_advances == 5  # 5 on the CPU too
    d.want("a", [True] * LAYERS)
    for _ in range(6):
        d.step([("a", 1), ("b", 1)])
    assert core.advanced_decode_steps > advanced
    d.check_at_rest()


def test_cuda_identity_steady_steps_read_their_grown_tables_bit_exact():
    """Nothing offloaded on CUDA (the identity layout) with paged reads, as SGLang serves FlashInfer
    and Triton by default: steady steps are journalled and read tables grown from the last step's
    page lists (one upload, one device add: ``IdentityDecodeTables``); every read inside a step and
    at rest equals the shadow bit for bit."""
    core = make_core(None, device="cuda", page_size=4, pages=24)
    assert core.store.identity
    d = CoreDriver(core, seed=9, fast_decode=True, paged_reads=True)
    d.add("a")
    d.add("b")
    d.step([("a", 5), ("b", 3)])
    for _ in range(8):
        d.step([("a", 1), ("b", 1)])
    # the steady steps' tables are the grown identity tables, not a general build's StepTables
    # (run 21, H200: this asserted ``core.tables is None``, the test's own error)
    from sglang_ext.dataplane.identity_decode_tables import IdentityDecodeTables

    assert core.identity_decode.steps == 8 and isinstance(core.tables, IdentityDecodeTables)
    d.check_at_rest()


def test_flashinfer_decode_over_identity_tables_matches_dense():
    """FlashInfer over the identity layout's steady tables (page 16; two steps open a page): every
    layer of every step equals dense."""
    core = make_core(None, dtype=torch.bfloat16, device="cuda", page_size=16, head_dim=FLASHINFER_DIM)
    d = CoreDriver(core, seed=2, fast_decode=True, paged_reads=True)
    checked: list[int] = []
    check = _flashinfer_checker(core, d, checked)
    d.add("a")
    d.add("b")
    d.step([("a", 40), ("b", 23)])
    d.on_layer = check
    for _ in range(12):
        d.step([("a", 1), ("b", 1)])
    assert core.identity_decode.steps == 12 and len(checked) == 12 * LAYERS
    d.check_at_rest()


def test_flashinfer_decode_over_advanced_tables_matches_dense():
    """FlashInfer, as SGLang's layered decode runs it (page tables, no token tables, one plan per
    step), over resident steady steps of page 16: the steps after the first run on advanced tables
    (rows and lengths + 1 on the device; the two that open a page splice it in), and every layer of every
    step equals dense."""
    core = make_core(PAGES + 6, dtype=torch.bfloat16, device="cuda", page_size=16, head_dim=FLASHINFER_DIM)
    d = CoreDriver(core, seed=2, fast_decode=True, paged_reads=True)
    checked: list[int] = []
    check = _flashinfer_checker(core, d, checked)
    d.add("a")
    d.add("b")
    d.step([("a", 40), ("b", 23)])  # decode lens a 41..52 (opens a page at 49), b 24..35 (at 33)
    d.on_layer = check
    for _ in range(12):
        d.step([("a", 1), ("b", 1)])
    assert core.advanced_decode_steps >= 8 and core.opened_advances == 2 and len(checked) == 12 * LAYERS
    d.check_at_rest()


def test_cuda_store_without_a_host_tier_probes_its_scratch_and_moves_nothing():
    """The served identity layout on CUDA (``SlotStoreConfig.host_tier=False``): the copy engines'
    probes run on the one-page pinned scratch and end where they end on a full host pool (``dma``
    where the driver takes it: no fallback warning at start), and the offload scenario --
    offloads, a pause, a resume -- reads bit-exact with no byte copied."""
    from sglang_ext.dataplane.layered_kv_core import LayeredKVCore
    from sglang_ext.dataplane.slot_store_config import SlotStoreConfig

    def core(host_tier: bool) -> LayeredKVCore:
        return LayeredKVCore(SlotStoreConfig(
            layers=LAYERS, page_size=2, kv_heads=HEADS, head_dim=4, logical_pages=PAGES, device_pages=LAYERS * PAGES,
            dtype=torch.float32, device="cuda", copy_engine="dma", host_tier=host_tier))

    full, scratch = core(True), core(False)
    store = scratch.store
    assert store.host.shape[0] == 1 and store.host.is_pinned()
    assert store.engine.impl == full.store.engine.impl, (store.engine.dma_error, store.engine.pitched_error)
    assert (store.engine.pitched_error is None) == (full.store.engine.pitched_error is None), store.engine.pitched_error
    offload_scenario(CoreDriver(scratch, seed=3))
    assert (store.h2d_bytes, store.d2h_bytes) == (0, 0)


@pytest.mark.parametrize("engine", ["triton", "dma"])
@pytest.mark.parametrize("budget", [60, 22])
def test_cuda_shared_prefix_staged_once_bit_exact(engine, budget, monkeypatch):
    """A prefix three staged requests share (``staging_columns.py``): one staging page and one
    fetch per distinct host-only layer-page -- the Triton fetch kernel skips the readers'
    entries, the copy engines copy the owners' segments -- every read bit-exact, and at 22
    device pages (where per-column staging overflowed every step) no step at rest."""
    from tests.dataplane.test_shared_staging import _decode, _prefix_batch

    core = _dma_core(budget, monkeypatch) if engine == "dma" else make_core(budget, device="cuda")
    d = CoreDriver(core, seed=4, paged_reads=True, fast_decode=True)  # as the paged decode backends serve
    _prefix_batch(d)
    seen = _decode(d, 4)
    d.check_at_rest()
    assert len(seen) == 4 and core.overflow_steps == 0, (seen, core.overflow_steps)
    # at 60 pages the steady steps advance with the sharing kept (at 22 the residency moves pages every step)
    assert (core.staged_advances >= 2) == (budget == 60), core.staged_advances
    assert all(staged == distinct and fetched == host for staged, distinct, fetched, host in seen), seen
