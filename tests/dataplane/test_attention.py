"""Layered paged attention equals dense attention over the shadow KV, for random placements."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_ext.dataplane import LayeredKVCache, dense_attention, torch_layered_attention
from tests.dataplane.harness import empty_shadow, run_step, small_config

LAYERS = 4
Q_HEADS = 4  # GQA: 2 query heads per KV head (small_config has 2 KV heads)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[int], list[list[int]], list[int], int]:
    n = draw(st.integers(1, 4))
    prompt = draw(st.lists(st.integers(1, 13), min_size=n, max_size=n))
    placement = draw(
        st.lists(st.lists(st.integers(0, 1), min_size=LAYERS, max_size=LAYERS), min_size=n, max_size=n)
    )
    q_lens = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
    return prompt, placement, q_lens, draw(st.integers(0, 2**16))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_layered_attention_equals_dense(scenario) -> None:
    """In every layer's window, paged attention over the layer-aware table equals dense
    attention over exactly what was written (fp32, atol 1e-5), decode and extend alike, and the
    token-slot view of the layer reads exactly the written keys."""
    prompt, placement, q_lens, seed = scenario
    cache = LayeredKVCache(small_config(device_blocks=80, host_blocks=80))
    shadow = {}
    rids = [f"r{i}" for i in range(len(prompt))]
    for rid, n in zip(rids, prompt, strict=True):
        cache.alloc_request(rid)
        shadow[rid] = empty_shadow(cache.config)
        run_step(cache, {rid: n}, shadow, seed)
    cache.install_placement(dict(zip(rids, placement, strict=True)))
    gen = torch.Generator().manual_seed(seed)
    total_q = sum(q_lens)
    q = torch.randn(LAYERS, total_q, Q_HEADS, cache.config.head_dim, generator=gen)
    qo_indptr = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist())
    checked = []

    def check(layer, view):
        assert view.rids == tuple(rids)
        got = torch_layered_attention(
            q[layer], qo_indptr, view.k_cache, view.v_cache, view.kv_indptr, view.kv_indices, view.kv_lens
        )
        for b, rid in enumerate(rids):
            k, v = shadow[rid][layer]
            ref = dense_attention(q[layer, qo_indptr[b] : qo_indptr[b + 1]], k, v)
            torch.testing.assert_close(got[qo_indptr[b] : qo_indptr[b + 1]], ref, rtol=0, atol=1e-5)
        # Token-indexed view of the same layer (SGLang torch_native style) reads the same KV.
        locs = cache.layer_token_locs(layer)
        k_flat = view.k_cache.reshape(-1, *view.k_cache.shape[2:])
        offsets = [0] + torch.cumsum(view.kv_lens, 0).tolist()
        for b, rid in enumerate(rids):
            assert torch.equal(k_flat[locs[offsets[b] : offsets[b + 1]]], shadow[rid][layer][0])
        checked.append(layer)

    run_step(cache, dict(zip(rids, q_lens, strict=True)), shadow, seed + 1, on_layer=check)
    assert checked == list(range(LAYERS))


def test_dense_attention_single_key_returns_value() -> None:
    """With one key, attention returns that key's value for every query head (GQA mapping)."""
    k = torch.randn(1, 2, 4)
    v = torch.randn(1, 2, 4)
    out = dense_attention(torch.randn(1, 4, 4), k, v)
    torch.testing.assert_close(out[0, :2], v[0, :1].expand(2, 4))
    torch.testing.assert_close(out[0, 2:], v[0, 1:].expand(2, 4))
