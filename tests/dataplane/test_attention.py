"""Layered paged attention over the served core's step tables equals dense attention over the
shadow KV, for random placements, decode and extend alike (fp32, atol 1e-5)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_ext.dataplane import dense_attention, torch_layered_attention
from tests.dataplane.core_driver import DIM, LAYERS, PAGES, CoreDriver, make_core

Q_HEADS = 4  # GQA: 2 query heads per KV head


@st.composite
def scenarios(draw: st.DrawFn) -> tuple:
    n = draw(st.integers(1, 4))
    prompt = draw(st.lists(st.integers(1, 9), min_size=n, max_size=n))
    placement = draw(st.lists(st.lists(st.booleans(), min_size=LAYERS, max_size=LAYERS), min_size=n, max_size=n))
    q_lens = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
    budget = draw(st.sampled_from([None, PAGES, PAGES + 20]))
    return prompt, placement, q_lens, budget, draw(st.integers(0, 2**16))


@settings(max_examples=30, deadline=None)
@given(scenarios())
def test_layered_attention_over_the_step_tables_equals_dense(scenario) -> None:
    """In every layer of a staged step, paged attention over ``tab[l]`` (resident pages and staged
    host pages) equals dense attention over exactly what was written, and the token-row view of the
    layer (the torch-native path) reads exactly the written keys."""
    prompt, placement, q_lens, budget, seed = scenario
    core = make_core(budget)
    core.paged_reads = True  # the paged backends' tables, in the identity layout too
    rids = [f"r{i}" for i in range(len(prompt))]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(LAYERS, sum(q_lens), Q_HEADS, DIM, generator=gen)
    qo_indptr = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    checked = []

    def check(layer: int) -> None:
        tables = core.tables
        if tables is None:
            return
        k_cache, v_cache = core.store.dev[0], core.store.dev[1]
        got = torch_layered_attention(q[layer], qo_indptr, k_cache, v_cache, tables.kv_indptr,
                                      tables.tab[layer], tables.kv_lens)
        k_all, _ = core.device_kv()
        if not core.store.identity:
            rows = core.token_rows(layer)
        for b, rid in enumerate(rids):
            slots = driver.slots[rid]
            k = torch.stack([driver.shadow[(layer, s)][0] for s in slots])
            v = torch.stack([driver.shadow[(layer, s)][1] for s in slots])
            lo, hi = int(qo_indptr[b]), int(qo_indptr[b + 1])
            ref = dense_attention(q[layer, lo:hi], k, v)
            torch.testing.assert_close(got[lo:hi], ref, rtol=0, atol=1e-5)
            if not core.store.identity:
                assert torch.equal(k_all[rows[b, : len(slots)]], k)
        checked.append(layer)

    driver = CoreDriver(core, seed=seed)
    for rid, n in zip(rids, prompt, strict=True):
        driver.add(rid)
        driver.step([(rid, n)])
    for rid, row in zip(rids, placement, strict=True):
        driver.want(rid, row)
    driver.on_layer = check
    assert driver.step(list(zip(rids, q_lens, strict=True)))
    assert checked == list(range(LAYERS))


def test_dense_attention_single_key_returns_value() -> None:
    """With one key, attention returns that key's value for every query head (GQA mapping)."""
    k = torch.randn(1, 2, 4)
    v = torch.randn(1, 2, 4)
    out = dense_attention(torch.randn(1, 4, 4), k, v)
    torch.testing.assert_close(out[0, :2], v[0, :1].expand(2, 4))
    torch.testing.assert_close(out[0, 2:], v[0, 1:].expand(2, 4))


@pytest.mark.parametrize(("nq", "n", "hq", "hkv"), [(1, 37, 8, 2), (5, 37, 8, 2), (9, 9, 4, 4), (3, 20, 6, 1)])
def test_dense_attention_equals_torch_sdpa(nq, n, hq, hkv):
    """The reference every layered path is graded against, against torch's own attention: causal
    queries at the last nq positions, GQA, several keys, default and explicit scales. Controls:
    a wrong scale and a mask shifted by one position both differ."""
    gen = torch.Generator().manual_seed(nq * 100 + n)
    q, k, v = (torch.randn(x, h, 16, generator=gen) for x, h in ((nq, hq), (n, hkv), (n, hkv)))
    group = hq // hkv
    kq, vq = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    mask = torch.arange(n)[None, :] <= torch.arange(n - nq, n)[:, None]  # [nq, n] True: attend

    def sdpa(scale: float | None, attend: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), kq.transpose(0, 1), vq.transpose(0, 1), attn_mask=attend, scale=scale)
        return out.transpose(0, 1)

    torch.testing.assert_close(dense_attention(q, k, v), sdpa(None, mask), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dense_attention(q, k, v, sm_scale=0.3), sdpa(0.3, mask), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(dense_attention(q, k, v, sm_scale=0.3), sdpa(None, mask), atol=1e-3)
    if nq > 1:  # a mask one position later lets an earlier query see its next key
        shifted = torch.arange(n)[None, :] <= torch.arange(n - nq, n)[:, None] + 1
        assert not torch.allclose(dense_attention(q, k, v), sdpa(None, shifted), atol=1e-3)
