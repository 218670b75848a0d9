"""Test harness: drive LayeredKVCache steps like a model would, keeping a shadow copy of the KV."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from sglang_ext.dataplane import DevicePoolFull, HostPoolFull, LayeredKVCache, LayeredKVConfig
from sglang_ext.dataplane.results import LayerView

Shadow = dict[str, list[tuple[torch.Tensor, torch.Tensor]]]
"""rid -> per layer (k [T, H, D], v [T, H, D]): what the model wrote."""


def small_config(**over: object) -> LayeredKVConfig:
    base: dict[str, object] = dict(
        layers=4, block_size=4, kv_heads=2, head_dim=4, device_blocks=40, dtype=torch.float32
    )
    base.update(over)
    host_blocks = int(base.pop("host_blocks", 64))  # type: ignore[call-overload]
    probe = LayeredKVConfig(**base, host_pool_gb=1.0)  # type: ignore[arg-type]
    return LayeredKVConfig(**base, host_pool_gb=host_blocks * probe.host_block_bytes / 1e9)  # type: ignore[arg-type]


def run_step(
    cache: LayeredKVCache,
    batch: Mapping[str, int],
    shadow: Shadow,
    seed: int,
    on_layer: Callable[[int, LayerView], None] | None = None,
) -> list[str]:
    """Append ``batch`` tokens and run one forward step writing random K/V; returns the ids that
    took part (a request whose append was refused is skipped, as a scheduler would)."""
    c = cache.config
    gen = torch.Generator().manual_seed(seed)
    appended = {}
    for rid, n in batch.items():
        try:
            appended[rid] = cache.append_tokens(rid, n)
        except (DevicePoolFull, HostPoolFull):
            continue  # a refused append changes nothing; the scheduler would not run it
    rids = list(appended)
    cache.begin_step(rids)
    k_flat = cache.device_pool.k_cache.view(-1, c.kv_heads, c.head_dim)
    v_flat = cache.device_pool.v_cache.view(-1, c.kv_heads, c.head_dim)
    for layer in range(c.layers):
        cache.wait_layer(layer)
        for rid, res in appended.items():
            n = res.locs.shape[1]
            k = torch.randn(n, c.kv_heads, c.head_dim, generator=gen).to(c.dtype)
            v = torch.randn(n, c.kv_heads, c.head_dim, generator=gen).to(c.dtype)
            k_flat[res.locs[layer]] = k.to(c.device)
            v_flat[res.locs[layer]] = v.to(c.device)
            old_k, old_v = shadow[rid][layer]
            shadow[rid][layer] = (torch.cat([old_k, k]), torch.cat([old_v, v]))
        if on_layer is not None:
            on_layer(layer, cache.layer_view(layer))
        cache.end_layer(layer)
    cache.end_step()
    return rids


def empty_shadow(c: LayeredKVConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    z = torch.zeros(0, c.kv_heads, c.head_dim, dtype=c.dtype)
    return [(z, z) for _ in range(c.layers)]


def assert_matches_shadow(cache: LayeredKVCache, shadow: Shadow) -> None:
    """Every request's KV, wherever it lives, is bit-exact with what the model wrote."""
    for rid, per_layer in shadow.items():
        for layer, (k, v) in enumerate(per_layer):
            got_k, got_v = cache.read_kv(rid, layer)
            assert torch.equal(got_k, k), f"{rid} layer {layer}: K differs"
            assert torch.equal(got_v, v), f"{rid} layer {layer}: V differs"
