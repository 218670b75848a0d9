"""`kvplane profile`: per-layer compute vs batch tokens and H2D/D2H bandwidth -> a profile file.

The profile (schema: :mod:`sglang_ext.dataplane.profile_schema`) is what the planner and the
simulator load: ``layer_compute_ms`` is the least-squares affine fit ``{fixed_ms, per_token_ms}``
over the measured points (kept under ``measured_points``), where *tokens* is the number of
sequences decoded in the step, each over ``--context`` tokens. Layer compute is measured on a synthetic Llama-style decoder layer of the given
shape (QKV and output projections, gated MLP, decode attention over ``--context`` tokens per
sequence); bandwidth is the data plane's own batched block copy between the block-first host pool
and the device pool.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kernels.block_copy import copy_segments
from sglang_ext.dataplane.bench_env import (
    NO_GPU_EXIT,
    add_device_argument,
    describe_device,
    resolve_device,
    time_ms,
    write_result,
)
from sglang_ext.dataplane.profile_schema import DeviceProfile


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
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", default=None, help="profile file (default under --out-dir)")


def layer_ms(args: argparse.Namespace, device: str, tokens: int, dtype: torch.dtype) -> float:
    """One synthetic decoder layer's decode time for ``tokens`` sequences (one new token each)."""
    h, i = args.hidden, args.intermediate
    qkv = torch.randn(h, (args.q_heads + 2 * args.kv_heads) * args.head_dim, device=device, dtype=dtype)
    o = torch.randn(args.q_heads * args.head_dim, h, device=device, dtype=dtype)
    gate_up = torch.randn(h, 2 * i, device=device, dtype=dtype)
    down = torch.randn(i, h, device=device, dtype=dtype)
    k = torch.randn(tokens, args.kv_heads, args.context, args.head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    x = torch.randn(tokens, h, device=device, dtype=dtype)
    group = args.q_heads // args.kv_heads

    def layer() -> torch.Tensor:
        y = x @ qkv
        q = y[:, : args.q_heads * args.head_dim].view(tokens, args.kv_heads, group, args.head_dim)
        att = torch.softmax(torch.einsum("bkgd,bktd->bkgt", q, k) * args.head_dim**-0.5, -1)
        a = torch.einsum("bkgt,bktd->bkgd", att, v).reshape(tokens, -1)
        z = x + a @ o
        gu = z @ gate_up
        return z + (torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]) @ down

    return time_ms(layer, device, args.repeat)


def bandwidth_gbps(args: argparse.Namespace, device: str, dtype: torch.dtype) -> tuple[float, float, int]:
    seg = args.block_size * args.kv_heads * args.head_dim
    n = args.copy_blocks
    host = torch.randn(n, 2, 2, seg).to(dtype)  # block-first: [blocks, layers=2, K/V, seg]
    if device == "cuda":
        host = host.pin_memory()
    hs = host.view(-1, seg)
    dev = torch.zeros(2 * n, seg, dtype=dtype, device=device)
    src = torch.arange(0, 4 * n, 2).to(device)  # layer 0's K and V of every block
    dst = torch.arange(2 * n).to(device)
    impl = "triton" if device == "cuda" else "torch"
    nbytes = 2 * n * seg * dev.element_size()
    h2d = time_ms(lambda: copy_segments(hs, dev, src, dst, impl=impl), device, args.repeat)
    d2h = time_ms(lambda: copy_segments(dev, hs, dst, src, impl=impl), device, args.repeat)
    return nbytes / h2d / 1e6, nbytes / d2h / 1e6, 2 * seg * dev.element_size()


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
    profile = DeviceProfile(
        device=name,
        layers=args.layers,
        block_size=args.block_size,
        block_bytes=block_bytes,
        h2d_gbps=h2d,
        d2h_gbps=d2h,
        fixed_ms=fixed,
        per_token_ms=per_token,
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
