"""``RecomputeForward``'s per-layer work on the recompute rows, without a server: the prefixes'
causal attention runs PyTorch's SDPA on 4-D inputs (before torch 2.14 its fused flash /
memory-efficient kernels took only those, and 3-D ones fell to its math path, which on a GPU
builds each prefix's ``[H, T, T]`` scores in fp32: gigabytes at a few thousand tokens; the pinned
2.14.1 adds the batch dimension itself), and equals a dense causal
reference; the recomputed K/V reach the core in the pool's dtype, as the pool converts new K/V
(a model's activations in another dtype than ``--kv-cache-dtype`` would make the store's write
raise). The served proof is ``tests/sglang/test_recompute_server.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from sglang_ext.recompute_forward import RecomputeForward

HQ, HK, D = 4, 2, 8


def _dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``[T, Hq, D]`` causal attention in fp64, K/V heads shared by ``Hq // Hk`` query heads."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    logits = torch.einsum("thd,shd->hts", q.double(), k) * scale
    t = q.shape[0]
    logits = logits.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", logits.softmax(-1), v)


def test_prefix_attention_runs_sdpa_on_4d_inputs_and_equals_the_dense_reference(monkeypatch):
    """Two decode rows, then three prefixes' rows (spans of 5, 3 and 4 tokens; the last one's
    ``k`` below this layer: zeroed). The control: the recorded call shapes would show a 3-D call."""
    seen: list[int] = []
    real = F.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):  # noqa: ANN001, ANN003, ANN202
        seen.append(q.dim())
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    rec = RecomputeForward()
    rec.batch = 2
    rec.rows = SimpleNamespace(active=[12, 8], spans=[(0, 5, 3), (5, 8, 2), (8, 12, 1)])
    g = torch.Generator().manual_seed(0)
    rows = 2 + 12
    q, k, v = (torch.randn(rows, h * D, generator=g) for h in (HQ, HK, HK))
    o = torch.full((rows, HQ * D), 7.0)
    layer = SimpleNamespace(tp_q_head_num=HQ, tp_k_head_num=HK, qk_head_dim=D, v_head_dim=D, scaling=D ** -0.5)
    rec.attend(1, q, k, v, o, layer)  # layer 1: the spans of k 3 and 2 attend; k 1's rows are zeroed
    assert seen == [4, 4]
    out = o.view(rows, HQ, D)
    for a, b in ((2, 7), (7, 10)):
        want = _dense_causal(q.view(rows, HQ, D)[a:b], k.view(rows, HK, D)[a:b], v.view(rows, HK, D)[a:b],
                             D ** -0.5)
        torch.testing.assert_close(out[a:b].double(), want, atol=1e-5, rtol=1e-5)
    assert (out[10:] == 0).all() and (out[:2] == 7).all()  # zeroed past the active rows; decode rows untouched


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32])
def test_recomputed_kv_reach_the_core_in_the_pools_dtype(pool_dtype):
    """fp32 activations, a bf16 pool: the rows handed to ``write_recompute`` are bf16 (the store's
    write takes its own dtype only); with an fp32 pool they are unchanged. Shapes ``[rows, H, D]``."""
    from sglang_ext.layered_pool import LayeredTokenToKVPool

    written = []
    core = SimpleNamespace(write_recompute=lambda layer, k, v: written.append((layer, k, v)))
    pool = SimpleNamespace(dtype=pool_dtype, store_dtype=pool_dtype, head_num=HK, head_dim=D, core=core)
    pool.stored_kv = lambda *args: LayeredTokenToKVPool.stored_kv(pool, *args)  # the pool's own conversion
    rec = RecomputeForward()
    rec.batch = 2
    k, v = torch.randn(6, HK * D), torch.randn(6, HK * D)
    layer = SimpleNamespace(tp_k_head_num=HK, qk_head_dim=D, v_head_dim=D)
    rec.write(pool, 3, k, v, layer)
    (index, k_rec, v_rec), = written
    assert index == 3 and k_rec.dtype == v_rec.dtype == pool_dtype and k_rec.shape == (4, HK, D)
    torch.testing.assert_close(k_rec.float(), k[2:].view(4, HK, D).to(pool_dtype).float(), rtol=0, atol=0)
    assert rec.layer_rows == 4
