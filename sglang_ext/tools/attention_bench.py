"""`kvplane bench attention`: a decode step under a placement vs all-resident, and the measured
stall vs the placement model's prediction (``controlplane.model.step_time_ms``).

Each layer runs paged decode attention over the layered tables (FlashInfer on CUDA when
importable, else the torch reference) plus a gated-MLP-sized matmul standing in for the rest of
the layer. The model's inputs are measured in the same run: per-layer compute from the
all-resident step, bandwidth from one batched fetch of one layer of every request.
Target (issue 4): measured stall within 10% of the model. On CPU the transfer engine is
synchronous (no overlap), so the CPU figure shows the no-overlap upper bound, labelled CPU.
"""

from __future__ import annotations

import argparse

import torch

from controlplane.model import step_time_ms
from sglang_ext.dataplane import LayeredKVCache, LayeredKVConfig, torch_layered_attention
from sglang_ext.dataplane.bench_env import (
    NO_GPU_EXIT,
    add_device_argument,
    describe_device,
    resolve_device,
    sync,
    time_ms,
    write_result,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_device_argument(parser)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=4096, help="size of the stand-in MLP")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--context", type=int, default=2048, help="tokens per request")
    parser.add_argument("--offload-every", type=int, default=2, help="offload every N-th layer")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--host-pool-gb", type=float, default=4.0)


class _Stepper:
    """Runs decode steps over a LayeredKVCache with attention + MLP per layer."""

    def __init__(self, args: argparse.Namespace, device: str) -> None:
        dtype = torch.float16 if device == "cuda" else torch.float32
        blocks = -(-(args.context + 4 * args.repeat + 16) // args.block_size)
        self.cfg = LayeredKVConfig(
            layers=args.layers, block_size=args.block_size, kv_heads=args.kv_heads,
            head_dim=args.head_dim, device_blocks=blocks * args.requests * (args.layers + 1),
            host_pool_gb=args.host_pool_gb, dtype=dtype, device=device,
        )
        self.cache = LayeredKVCache(self.cfg)
        self.rids = [f"r{i}" for i in range(args.requests)]
        self.q = torch.randn(args.requests, args.q_heads, args.head_dim, device=device, dtype=dtype)
        self.w1 = torch.randn(args.hidden, 4 * args.hidden, device=device, dtype=dtype) * 0.01
        self.w2 = torch.randn(4 * args.hidden, args.hidden, device=device, dtype=dtype) * 0.01
        self.x = torch.randn(args.requests, args.hidden, device=device, dtype=dtype)
        self.qo = torch.arange(args.requests + 1, device=device)
        self.fi = None
        if device == "cuda":
            from sglang_ext.dataplane.flashinfer_attention import (
                HAVE_FLASHINFER,
                FlashInferLayeredDecode,
            )

            if HAVE_FLASHINFER:
                self.fi = FlashInferLayeredDecode(device, max_pages=blocks * args.requests)
        for rid in self.rids:
            self.cache.alloc_request(rid)
        for rid in self.rids:
            self.cache.append_tokens(rid, args.context)
        self.step(append=False)

    @property
    def attention(self) -> str:
        return "flashinfer" if self.fi is not None else "torch reference"

    def step(self, append: bool = True) -> None:
        c = self.cache
        if append:
            for rid in self.rids:
                c.append_tokens(rid, 1)
        c.begin_step(self.rids)
        for layer in range(self.cfg.layers):
            c.wait_layer(layer)
            v = c.layer_view(layer)
            if self.fi is not None:
                if layer == 0:
                    self.fi.plan(v, self.q.shape[1])
                self.fi.run(self.q, v)
            else:
                torch_layered_attention(self.q, self.qo, v.k_cache, v.v_cache, v.kv_indptr, v.kv_indices, v.kv_lens)
            (self.x @ self.w1) @ self.w2
            c.end_layer(layer)
        c.end_step()


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device, "bench attention")
    if device is None:
        return NO_GPU_EXIT
    if args.offload_every < 1:
        raise SystemExit(f"--offload-every must be >= 1, got {args.offload_every}")
    name = describe_device(device)
    s = _Stepper(args, device)
    L = args.layers
    resident_ms = time_ms(s.step, device, args.repeat)
    comp = [resident_ms / L] * L
    row = [0 if (layer + 1) % args.offload_every == 0 else 1 for layer in range(L)]
    s.cache.install_placement({r: row for r in s.rids})
    # Bandwidth as the model sees it: one batched fetch of one offloaded layer of every request.
    t, hp, dp = s.cache._reqs, s.cache.host_pool, s.cache.device_pool
    off = row.index(0) if 0 in row else 0
    src = sum((hp.segs(t[r].host_blocks, off) for r in s.rids), [])
    dst = sum((dp.segs(t[r].staging or t[r].dev[off] or []) for r in s.rids), [])
    eng = s.cache.engine

    def fetch() -> None:
        eng.host_wait([eng.h2d(src, dst)])

    fetch_ms = time_ms(fetch, device, args.repeat)
    blocks = [s.cache.blocks(r) for r in s.rids]
    bw = sum(blocks) / fetch_ms
    placed_ms = time_ms(s.step, device, args.repeat)
    sync(device)
    blocks = [s.cache.blocks(r) for r in s.rids]
    predicted = step_time_ms([row] * len(s.rids), blocks, comp, bw)
    stall_measured = placed_ms - resident_ms
    stall_pred = predicted - sum(comp)
    if device == "cpu":  # synchronous copies: every fetch is on the critical path
        stall_pred = sum(b * row.count(0) for b in blocks) / bw
    err = abs(stall_measured - stall_pred) / stall_pred if stall_pred > 0 else float("nan")
    print(f"kvplane bench attention on {name} ({s.attention}; {args.requests} requests x "
          f"{args.context} tokens, {L} layers, offload every {args.offload_every})")
    print(f"  all-resident step {resident_ms:.3f} ms, placed step {placed_ms:.3f} ms")
    print(f"  bandwidth {bw:.2f} blocks/ms; stall measured {stall_measured:.3f} ms, "
          f"model {stall_pred:.3f} ms{' (no overlap on CPU)' if device == 'cpu' else ''}, "
          f"relative error {err:.1%}")
    path = write_result(args.out_dir, "attention", name, {
        "figure": "decode step with placement vs all-resident; measured stall vs step_time_ms",
        "device": device, "attention": s.attention,
        "params": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "placement_row": row, "resident_step_ms": resident_ms, "placed_step_ms": placed_ms,
        "layer_compute_ms": comp[0], "bw_blocks_per_ms": bw, "predicted_step_ms": predicted,
        "stall_measured_ms": stall_measured, "stall_predicted_ms": stall_pred,
        "stall_relative_error": err,
    })
    print(f"result: {path}")
    return 0
