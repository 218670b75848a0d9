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
    """Available memory room for the host pool alone (1.5x it at 80%): without a device budget
    the device pool holds every layer too and the start is refused, naming both pools and the
    flags; with a small --kv-gpu-budget-tokens the same pool starts (control)."""
    monkeypatch.setattr(layered_pool, "available_host_bytes", lambda: int(1.5 * HOST_BYTES / 0.8))
    with pytest.raises(ValueError, match=r"device KV pool, which on CPU is host memory too") as err:
        _pool(None)
    assert "--kv-gpu-budget-tokens" in str(err.value)
    pool = _pool(LAYERS * SLOTS // 4)  # a quarter of the layer-pages on the "device"
    assert pool.store.dev[0].numel() > 0
