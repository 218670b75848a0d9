"""The layered pool on CUDA: round trip through device and pinned host, FlashInfer decode over its tables.

Needs a GPU (``gpu`` marker; skipped cleanly without CUDA or flashinfer). Not run on the
CPU-only development host.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_ext.args import LayeredKVArgs
from sglang_ext.dataplane.attention import dense_attention
from sglang_ext.dataplane.slot_results import RequestResidency

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("sglang")  # the GPU check host has no SGLang: the served core's GPU tests cover it there

from sglang_ext.dataplane.flashinfer_attention import HAVE_FLASHINFER, FlashInferLayeredDecode  # noqa: E402
from sglang_ext.dataplane.results import LayerView  # noqa: E402
from sglang_ext.layered_pool import LayeredTokenToKVPool  # noqa: E402

LAYERS, KV_HEADS, Q_HEADS, DIM, PAGE = 4, 2, 8, 128, 16


def make_cuda_pool(budget_tokens: int, copy_programs: int | None = None) -> LayeredTokenToKVPool:
    return LayeredTokenToKVPool(
        size=4096,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=KV_HEADS,
        head_dim=DIM,
        layer_num=LAYERS,
        device="cuda",
        enable_memory_saver=False,
        layered_args=LayeredKVArgs(enable_layered_kv=True, kv_gpu_budget_tokens=budget_tokens,
                                   kv_copy_programs=copy_programs),
    )


def test_copy_programs_reach_the_cuda_engine():
    """``--kv-copy-programs`` sets the served CUDA engine's copy launches."""
    assert make_cuda_pool(PAGE * 64, copy_programs=8).store.engine.copy_programs == 8
    assert make_cuda_pool(PAGE * 64).store.engine.copy_programs is None


def fill(pool: LayeredTokenToKVPool, lengths: dict[str, int]) -> dict[str, torch.Tensor]:
    """Write random K/V for requests of these lengths (disjoint page runs); return their slots."""
    slots, start, shadow = {}, PAGE, {}
    for rid, n in lengths.items():
        s = torch.arange(start, start + n, device="cuda")
        start += -(-n // PAGE) * PAGE
        slots[rid] = s
        pool.prepare_step([(rid, s.cpu())], s, [n])
        for layer in range(LAYERS):
            pool.enter_layer(layer)
            k = torch.randn((n, KV_HEADS, DIM), device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            pool.set_kv_buffer(SimpleNamespace(layer_id=layer), s, k, v)
            pool.exit_layer(layer)
            shadow[(rid, layer)] = (k, v)
    pool.shadow = shadow
    return slots


def test_round_trip_bit_exact_on_cuda_with_offloaded_layers():
    """K/V read back bit-exact on CUDA after offloading half the layers to pinned host memory."""
    pool = make_cuda_pool(budget_tokens=PAGE * 64)
    slots = fill(pool, {"a": 100, "b": 37})
    assert pool.store.host.is_pinned()
    for rid, s in slots.items():
        pages = tuple(dict.fromkeys((s // PAGE).tolist()))
        pool.update_residency({rid: RequestResidency(pages=pages, gpu_layers=(True, False, True, False))})
    torch.cuda.synchronize()
    for (rid, layer), (k, v) in pool.shadow.items():
        got_k, got_v = pool.layer_kv(layer, slots[rid])
        assert torch.equal(got_k, k) and torch.equal(got_v, v)


@pytest.mark.skipif(not HAVE_FLASHINFER, reason="flashinfer not importable")
def test_flashinfer_decode_over_layered_tables_matches_dense():
    """FlashInfer decode with one plan per step over per-layer tables (staged host pages) == dense (bf16)."""
    pool = make_cuda_pool(budget_tokens=PAGE * 64)
    slots = fill(pool, {"a": 100, "b": 37})
    for rid, s in slots.items():
        pages = tuple(dict.fromkeys((s // PAGE).tolist()))
        pool.update_residency({rid: RequestResidency(pages=pages, gpu_layers=(True, False, False, True))})
    # a decode step of both requests: one new token each, in the next slot of each request
    new = torch.tensor([int(slots["a"][-1]) + 1, int(slots["b"][-1]) + 1], device="cuda")
    for (rid, s), slot in zip(slots.items(), new.tolist(), strict=True):
        slots[rid] = torch.cat([s, torch.tensor([slot], device="cuda")])
    pool.prepare_step([(rid, slots[rid].cpu()) for rid in ("a", "b")], new)
    tables = pool.tables
    assert tables is not None and tables.staging_ids.size > 0
    decode = FlashInferLayeredDecode("cuda", max_pages=pool.store.config.logical_pages)
    for layer in range(LAYERS):
        pool.enter_layer(layer)
        k_new = torch.randn((2, KV_HEADS, DIM), device="cuda", dtype=torch.bfloat16)
        v_new = torch.randn_like(k_new)
        pool.set_kv_buffer(SimpleNamespace(layer_id=layer), new, k_new, v_new)
        view = LayerView(layer, pool.store.dev[0], pool.store.dev[1], tables.kv_indptr, tables.tab[layer],
                         tables.kv_lens, tables.last_page_len, ("a", "b"))
        if layer == 0:
            decode.plan(view, Q_HEADS)
        q = torch.randn((2, Q_HEADS, DIM), device="cuda", dtype=torch.bfloat16)
        out = decode.run(q, view)
        for b, rid in enumerate(("a", "b")):
            k, v = pool.shadow[(rid, layer)]
            k = torch.cat([k, k_new[b : b + 1]])
            v = torch.cat([v, v_new[b : b + 1]])
            torch.testing.assert_close(out[b : b + 1], dense_attention(q[b : b + 1], k, v), atol=2e-2, rtol=2e-2)
        pool.exit_layer(layer)
    assert pool.tables is None


def _capped_windowed(q, k, v, scale, cap, window):  # noqa: ANN001, ANN202
    """fp32 reference: GQA decode with ``cap * tanh(x / cap)`` logits and a left window."""
    rep = q.shape[1] // k.shape[1]
    kf, vf = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    logits = torch.einsum("hd,nhd->hn", q[0].float(), kf) * scale
    if cap > 0:
        logits = cap * torch.tanh(logits / cap)
    if window >= 0:
        logits[:, : max(0, k.shape[0] - window - 1)] = float("-inf")
    return torch.einsum("hn,nhd->hd", torch.softmax(logits, -1), vf)[None]


@pytest.mark.skipif(not HAVE_FLASHINFER, reason="flashinfer not importable")
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph-wrappers"])
def test_flashinfer_plans_soft_cap_and_window_per_layer_and_bounds_wrappers(graph):
    """Layers with different soft caps / windows (Gemma-2 style) each get their plan; outputs
    match an fp32 reference, on serving's eager wrappers (one per parameter set) and on the graph
    probe's CUDA-graph wrappers (their indices buffers grown from 1 on the first plan; at most
    MAX_WRAPPERS kept over many batch sizes)."""
    from sglang_ext.dataplane.flashinfer_attention import MAX_WRAPPERS, AttentionParams

    pool = make_cuda_pool(budget_tokens=PAGE * 64)
    slots = fill(pool, {"a": 100, "b": 37})
    pool.prepare_step([(rid, slots[rid].cpu()) for rid in ("a", "b")], None, [0, 0])
    tables = pool.tables
    decode = FlashInferLayeredDecode("cuda", max_pages=1)
    decode.new_step()
    settings = [(0.0, -1), (30.0, -1), (0.0, 15), (50.0, 31)]
    scale = DIM ** -0.5
    for layer, (cap, window) in enumerate(settings):
        pool.enter_layer(layer)
        view = LayerView(layer, pool.store.dev[0], pool.store.dev[1], tables.kv_indptr, tables.tab[layer],
                         tables.kv_lens, tables.last_page_len, ("a", "b"))
        params = AttentionParams(num_qo_heads=Q_HEADS, sm_scale=scale, logits_soft_cap=cap, window_left=window)
        decode.plan(view, Q_HEADS, params=params, graph=graph)
        q = torch.randn((2, Q_HEADS, DIM), device="cuda", dtype=torch.bfloat16)
        out = decode.run(q, view, params)
        for b, rid in enumerate(("a", "b")):
            k, v = pool.shadow[(rid, layer)]
            want = _capped_windowed(q[b : b + 1], k, v, scale, cap, window)
            torch.testing.assert_close(out[b : b + 1].float(), want, atol=3e-2, rtol=3e-2)
        pool.exit_layer(layer)
    assert decode.wrappers == len(settings)  # one a parameter set
    if not graph:
        return
    assert decode.max_pages >= int(tables.tab.shape[1])  # grown from 1 to hold the step's pages
    for batch in range(1, 3 * MAX_WRAPPERS):
        decode._graph_wrapper(batch, AttentionParams(num_qo_heads=Q_HEADS), torch.bfloat16, KV_HEADS)
    made = len(settings) + 3 * MAX_WRAPPERS - 1
    assert decode.wrappers == MAX_WRAPPERS and len(decode._retired) == made - MAX_WRAPPERS  # kept alive


def test_the_pool_writes_with_sglangs_store_kernel_including_row_zero():
    """On CUDA the pool hands the core SGLang's one-launch ``store_cache`` writer: a layer's write
    through it equals two ``index_copy_`` -- row 0 included (``reserved_skip_index=-1``); with
    SGLang's default skip index (the negative control) row 0 keeps its old bytes."""
    from sglang_ext import store_cache_writer
    from sglang_ext.store_cache_writer import StoreCacheWriter

    pool = make_cuda_pool(budget_tokens=512)
    writer = pool.store.row_writer
    assert isinstance(writer, StoreCacheWriter), "SGLang's store_cache was not built on this host"
    k_dst = torch.zeros(64, KV_HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    v_dst = torch.zeros_like(k_dst)
    rows = torch.tensor([0, 5, 63, 7], device="cuda")
    k = torch.randn(4, KV_HEADS, DIM, device="cuda").to(torch.bfloat16)
    v = torch.randn_like(k)
    want_k, want_v = k_dst.clone().index_copy_(0, rows, k), v_dst.clone().index_copy_(0, rows, v)
    writer(k_dst, v_dst, rows, k, v)
    torch.cuda.synchronize()
    assert writer.calls == 1 and torch.equal(k_dst, want_k) and torch.equal(v_dst, want_v)
    skipping = StoreCacheWriter(writer._store, writer.row_bytes)
    k_dst.zero_()
    store_cache_writer.NO_SKIP, saved = 0, store_cache_writer.NO_SKIP
    try:
        skipping(k_dst, v_dst, rows, k, v)
    finally:
        store_cache_writer.NO_SKIP = saved
    torch.cuda.synchronize()
    assert not torch.equal(k_dst, want_k) and torch.equal(k_dst[1:], want_k[1:])
