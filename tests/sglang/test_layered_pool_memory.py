"""The layered pool's start-up memory check on ``--device cpu``, where the device KV pool is host
memory too (a launch without ``--max-total-tokens`` sized 30 M tokens on a 23 GB host and the
scheduler was killed for memory once both pools were allocated)."""

from __future__ import annotations

import pytest
import torch

from sglang_ext.args import LayeredKVArgs

pytest.importorskip("sglang")  # sglang_ext.layered_pool imports SGLang at module level
import sglang_ext.layered_pool as layered_pool  # noqa: E402

LAYERS, HEADS, DIM, PAGE, SLOTS = 4, 2, 16, 1, 4096
HOST_BYTES = SLOTS * LAYERS * PAGE * 2 * HEADS * DIM * 4  # every layer of every slot, K and V, fp32


def _pool(budget_tokens: int | None) -> object:
    return layered_pool.LayeredTokenToKVPool(
        size=SLOTS, page_size=PAGE, dtype=torch.float32, head_num=HEADS, head_dim=DIM, layer_num=LAYERS,
        device="cpu", enable_memory_saver=False,
        layered_args=LayeredKVArgs(enable_layered_kv=True, kv_gpu_budget_tokens=budget_tokens),
    )


def test_the_cpu_device_pool_counts_against_available_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU the device pool is host memory too. Without a budget (the identity layout, no host
    tier) it is all the pool takes: at 1.1x its size available (at 80%) it starts, and a pool with
    a quarter budget, which pins the host pool beside its device pages, is refused (control); at
    0.9x the identity pool is refused too, naming the device pool and --max-total-tokens, not a
    smaller --kv-gpu-budget-tokens (that adds a host pool of every layer: control, the quarter
    budget's refusal names it)."""
    monkeypatch.setattr(layered_pool, "available_host_bytes", lambda: int(1.1 * HOST_BYTES / 0.8))
    pool = _pool(None)
    assert pool.store.identity and pool.store.host.numel() * 4 == HOST_BYTES // SLOTS  # one page
    with pytest.raises(ValueError, match=r"device KV pool, which on CPU is host memory too") as quarter:
        _pool(LAYERS * SLOTS // 4)  # a quarter of the layer-pages on the "device", every one on host
    assert "--kv-gpu-budget-tokens (a smaller device pool)" in str(quarter.value)
    monkeypatch.setattr(layered_pool, "available_host_bytes", lambda: int(0.9 * HOST_BYTES / 0.8))
    with pytest.raises(ValueError, match=r"device KV pool, which on CPU is host memory too") as err:
        _pool(None)
    assert "--max-total-tokens" in str(err.value) and "--kv-gpu-budget-tokens" not in str(err.value)
