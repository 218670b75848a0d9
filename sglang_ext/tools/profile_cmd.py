"""`kvplane profile`: per-layer compute vs batch tokens and H2D/D2H bandwidth -> a profile file.

The profile (schema: :mod:`sglang_ext.dataplane.profile_schema`) is what the planner and the
simulator load: ``layer_compute_ms`` is the least-squares affine fit ``{fixed_ms, per_token_ms}``
over the measured points (kept under ``measured_points``), where *tokens* is the number of
sequences decoded in the step, each over ``--context`` tokens.

Both are measured on the served data plane (:class:`~sglang_ext.tools.served_batch.ServedBatch`,
the ``LayeredKVCore`` SGLang runs): layer compute is one synthetic Llama-style decoder layer of the
given shape (QKV projection, the new K/V written through ``core.write``, paged decode attention
over the step's table ``tables.tab[l]`` -- FlashInfer on CUDA when importable, else the torch
reference --, output projection, gated MLP) inside a decode step of ``tokens`` sequences;
bandwidth is the store's transfer engine moving K and V of one layer of ``--copy-blocks`` pages
between the pinned block-first host pool and the device pool (``store.engine.h2d`` / ``d2h`` over
``store.host_segs`` / ``store.dev_segs``: the launches a step's fetches and write-backs are).

``recompute_ms_per_token`` (issue 16, ``docs/recompute.md``): the same synthetic layer runs a
prefill of ``--recompute-tokens`` prefix tokens (the projections and MLP over every token, causal
attention of the prefix to itself, as the served recompute rows run it) and its time is divided
by the tokens (eLLM §4.2.1 Eq. 2: linear in the recomputed tokens for the GEMMs, which dominate).
``--recompute-tokens 0`` leaves it out (then no recompute is planned for a worker using the file).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from sglang_ext.dataplane.bench_env import (
    NO_GPU_EXIT,
    add_device_argument,
    describe_device,
    resolve_device,
    time_ms,
    write_result,
)
from sglang_ext.dataplane.profile_schema import DeviceProfile
from sglang_ext.dataplane.slot_kv_store import SlotKVStore
from sglang_ext.dataplane.slot_store_config import SlotStoreConfig
from sglang_ext.tools.served_batch import DecodeAttention, ServedBatch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_device_argument(parser)
    parser.add_argument("--layers", type=int, default=32, help="layers of the served model")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=1024, help="context tokens per sequence")
    parser.add_argument("--tokens", default="1,8,32,128", help="batch sizes (tokens), comma list")
    parser.add_argument("--copy-blocks", type=int, default=256, help="blocks per bandwidth launch")
    parser.add_argument("--recompute-tokens", type=int, default=256,
                        help="prefix tokens of the recompute measurement (0: not measured)")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", default=None, help="profile file (default under --out-dir)")


def layer_ms(args: argparse.Namespace, device: str, tokens: int, dtype: torch.dtype) -> float:
    """One synthetic decoder layer's decode time for ``tokens`` sequences (one new token each),
    its KV written and read through the served core (a 2-layer batch; layer 0 is timed, inside
    one decode step: the step's bookkeeping is not counted)."""
    h, i = args.hidden, args.intermediate
    qkv = torch.randn(h, (args.q_heads + 2 * args.kv_heads) * args.head_dim, device=device, dtype=dtype)
    o = torch.randn(args.q_heads * args.head_dim, h, device=device, dtype=dtype)
    gate_up = torch.randn(h, 2 * i, device=device, dtype=dtype)
    down = torch.randn(i, h, device=device, dtype=dtype)
    x = torch.randn(tokens, h, device=device, dtype=dtype)
    batch = ServedBatch(layers=2, page_size=args.block_size, kv_heads=args.kv_heads, head_dim=args.head_dim,
                        requests=tokens, context=args.context, headroom=args.block_size, dtype=dtype, device=device)
    attn = DecodeAttention(batch, args.q_heads)
    core = batch.core
    nq, nkv = args.q_heads * args.head_dim, args.kv_heads * args.head_dim
    loc = batch.begin_decode()
    core.enter_layer(0)
    attn(0)  # FlashInfer plans once per step (all layers share it): not part of a layer

    def layer() -> torch.Tensor:
        y = x @ qkv
        attn.q = y[:, :nq].reshape(tokens, args.q_heads, args.head_dim).contiguous()
        k = y[:, nq: nq + nkv].reshape(tokens, args.kv_heads, args.head_dim)
        v = y[:, nq + nkv:].reshape(tokens, args.kv_heads, args.head_dim)
        core.write(0, loc, k, v)
        a = attn.run(0).reshape(tokens, -1)
        z = x + a @ o
        gu = z @ gate_up
        return z + (torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]) @ down

    try:
        return time_ms(layer, device, args.repeat)
    finally:
        for layer_id in range(batch.layers):
            core.exit_layer(layer_id)


def recompute_ms_per_token(args: argparse.Namespace, device: str, dtype: torch.dtype) -> float:
    """One synthetic decoder layer's prefill of ``--recompute-tokens`` prefix tokens (causal
    self-attention, the K/V heads shared by the query heads as in GQA) per token."""
    n, h, i, d = args.recompute_tokens, args.hidden, args.intermediate, args.head_dim
    nq, nkv = args.q_heads * d, args.kv_heads * d
    qkv = torch.randn(h, nq + 2 * nkv, device=device, dtype=dtype)
    o = torch.randn(nq, h, device=device, dtype=dtype)
    gate_up = torch.randn(h, 2 * i, device=device, dtype=dtype)
    down = torch.randn(i, h, device=device, dtype=dtype)
    x = torch.randn(n, h, device=device, dtype=dtype)
    group = args.q_heads // args.kv_heads

    def layer() -> torch.Tensor:
        y = x @ qkv
        q = y[:, :nq].reshape(n, args.q_heads, d).transpose(0, 1)
        k = y[:, nq: nq + nkv].reshape(n, args.kv_heads, d).transpose(0, 1).repeat_interleave(group, 0)
        v = y[:, nq + nkv:].reshape(n, args.kv_heads, d).transpose(0, 1).repeat_interleave(group, 0)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        z = x + a.transpose(0, 1).reshape(n, nq) @ o
        gu = z @ gate_up
        return z + (torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]) @ down

    return time_ms(layer, device, args.repeat) / n


def bandwidth_gbps(args: argparse.Namespace, device: str, dtype: torch.dtype) -> tuple[float, float, int]:
    """H2D and D2H GB/s of one engine launch moving K and V of layer 0 of ``--copy-blocks`` pages,
    and the bytes of one layer-page (the profile's block)."""
    n = args.copy_blocks
    store = SlotKVStore(SlotStoreConfig(
        layers=args.layers, page_size=args.block_size, kv_heads=args.kv_heads, head_dim=args.head_dim,
        logical_pages=n + 1, device_pages=n, dtype=dtype, device=device,
    ))
    eng = store.engine
    host = store.host_segs(np.zeros(n, dtype=np.int64), np.arange(1, n + 1))  # K then V of layer 0
    dev = store.dev_segs(np.arange(n))
    h_idx, d_idx = eng.index_tensor(host), eng.index_tensor(dev)
    nbytes = int(host.size) * eng.segment_bytes
    h2d = time_ms(lambda: eng.h2d(h_idx, d_idx, host_idx=(host, dev)), device, args.repeat)
    d2h = time_ms(lambda: eng.d2h(d_idx, h_idx, host_idx=(dev, host)), device, args.repeat)
    return nbytes / h2d / 1e6, nbytes / d2h / 1e6, store.config.layer_page_bytes


def affine_fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``ms = fixed + per_token * tokens``, both clamped at >= 0."""
    n = len(points)
    if n == 1:
        return max(0.0, points[0][1]), 0.0
    mt = sum(t for t, _ in points) / n
    mm = sum(m for _, m in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    slope = sum((t - mt) * (m - mm) for t, m in points) / var if var else 0.0
    slope = max(0.0, slope)
    return max(0.0, mm - slope * mt), slope


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device, "profile")
    if device is None:
        return NO_GPU_EXIT
    if args.q_heads % args.kv_heads:
        raise SystemExit(f"--q-heads {args.q_heads} must be a multiple of --kv-heads {args.kv_heads}")
    dtype = torch.float16 if device == "cuda" else torch.float32
    name = describe_device(device)
    tokens = sorted({int(t) for t in args.tokens.split(",") if t})
    points = []
    print(f"kvplane profile on {name}")
    for t in tokens:
        ms = layer_ms(args, device, t, dtype)
        points.append((t, ms))
        print(f"  layer compute, {t:>5} tokens: {ms:8.3f} ms")
    h2d, d2h, block_bytes = bandwidth_gbps(args, device, dtype)
    print(f"  batched H2D {h2d:.2f} GB/s, D2H {d2h:.2f} GB/s (block {block_bytes} bytes)")
    fixed, per_token = affine_fit(points)
    print(f"  fit: layer_ms = {fixed:.4f} + {per_token:.6f} * tokens")
    rms = recompute_ms_per_token(args, device, dtype) if args.recompute_tokens > 0 else None
    if rms is not None:
        print(f"  recompute: {rms:.6f} ms per prefix token per layer ({args.recompute_tokens}-token prefill)")
    profile = DeviceProfile(
        device=name,
        layers=args.layers,
        block_size=args.block_size,
        block_bytes=block_bytes,
        h2d_gbps=h2d,
        d2h_gbps=d2h,
        fixed_ms=fixed,
        per_token_ms=per_token,
        recompute_ms_per_token=rms,
    )
    extra = {
        "measured_points": [{"tokens": t, "ms": ms} for t, ms in points],
        "context_tokens": args.context,
        "tokens_meaning": "sequences decoded in the step (one new token each, --context each)",
    }
    if args.out:
        path = Path(args.out)
        path.write_text(json.dumps({**profile.to_dict(), **extra}, indent=2) + "\n")
    else:
        path = write_result(args.out_dir, "profile", name, {**profile.to_dict(), **extra})
    DeviceProfile.load(path)  # the file round-trips through the schema
    print(f"profile: {path}")
    return 0
