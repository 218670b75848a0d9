"""`kvplane bench attention`: a decode step under a placement vs all-resident, on the served core,
and the measured stall vs the placement model's prediction (``controlplane.model.step_time_ms``).

It drives the object SGLang runs (:class:`~sglang_ext.tools.served_batch.ServedBatch`: a
``LayeredKVCore`` with a pinned host pool and the CUDA transfer engine on a GPU): requests are
prefilled through the core, a plan is installed with ``update_residency(..., planned=True)``, and
each decode step is ``prepare_step`` + per layer ``enter_layer`` / ``write`` / paged decode
attention over ``tables.tab[l]`` (FlashInfer on CUDA when importable, else the torch reference)
plus a gated-MLP-sized matmul standing in for the rest of the layer / ``exit_layer``. The
all-resident and the placed steps run on the same pool (paged layout), so their difference is the
fetches, write-backs and staging the plan costs. The model's inputs are measured in the same run:
per-layer compute from the all-resident step, bandwidth from one batched engine fetch of one
layer of every request (``store.engine.h2d``). Target (issue 4): measured stall within 10% of the
model. On CPU the transfer engine is synchronous (no overlap), so the CPU figure shows the
no-overlap upper bound, labelled CPU.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from controlplane.model import step_time_ms
from sglang_ext.dataplane.bench_env import (
    NO_GPU_EXIT,
    add_device_argument,
    describe_device,
    resolve_device,
    sync,
    time_ms,
    write_result,
)
from sglang_ext.tools.served_batch import DecodeAttention, ServedBatch


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
    parser.add_argument("--seed", type=int, default=0)


class _Stepper:
    """Decode steps of a :class:`ServedBatch` with attention + MLP per layer."""

    def __init__(self, args: argparse.Namespace, device: str) -> None:
        dtype = torch.float16 if device == "cuda" else torch.float32
        self.batch = ServedBatch(
            layers=args.layers, page_size=args.block_size, kv_heads=args.kv_heads, head_dim=args.head_dim,
            requests=args.requests, context=args.context, headroom=2 * (args.repeat + 4) + args.block_size,
            dtype=dtype, device=device, seed=args.seed,
        )
        self.attn = DecodeAttention(self.batch, args.q_heads)
        self.repeat = args.repeat
        self.w1 = torch.randn(args.hidden, 4 * args.hidden, device=device, dtype=dtype) * 0.01
        self.w2 = torch.randn(4 * args.hidden, args.hidden, device=device, dtype=dtype) * 0.01
        self.x = torch.randn(args.requests, args.hidden, device=device, dtype=dtype)

    def _layer(self, layer: int) -> None:
        self.attn(layer)
        (self.x @ self.w1) @ self.w2

    def step(self) -> None:
        self.batch.decode_step(self._layer)

    def fetch_one_layer(self, layer: int) -> tuple[float, int]:
        """Time one batched engine fetch of ``layer`` of every request's pages into free device
        pages (what a step's first fetch launch is); returns (ms, layer-pages moved)."""
        core = self.batch.core
        store, eng = core.store, core.store.engine
        pages = np.asarray([p for i in range(len(self.batch.rids)) for p in self.batch.pages(i)], dtype=np.int64)
        ids = core.room.take(int(pages.size))
        if ids is None:
            raise RuntimeError("no free device pages for the bandwidth fetch")
        try:
            src = store.host_segs(np.full(pages.size, layer), pages)
            dst = store.dev_segs(ids)
            src_d, dst_d = eng.index_tensor(src), eng.index_tensor(dst)
            ms = time_ms(lambda: eng.h2d(src_d, dst_d, host_idx=(src, dst)), self.batch.device, self.repeat)
        finally:
            sync(self.batch.device)
            core.room.give_back(ids)
        return ms, int(pages.size)


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
    delta = s.batch.place([bool(x) for x in row])
    sync(device)
    # Bandwidth as the model sees it: one batched fetch of one offloaded layer of every request.
    off = row.index(0) if 0 in row else 0
    fetch_ms, fetched = s.fetch_one_layer(off)
    bw = fetched / fetch_ms
    placed_ms = time_ms(s.step, device, args.repeat)
    sync(device)
    stats = s.batch.core.stats()
    blocks = s.batch.blocks()
    predicted = step_time_ms([row] * len(s.batch.rids), blocks, comp, bw)
    stall_measured = placed_ms - resident_ms
    stall_pred = predicted - sum(comp)
    if device == "cpu":  # synchronous copies: every fetch is on the critical path
        stall_pred = sum(b * row.count(0) for b in blocks) / bw
    err = abs(stall_measured - stall_pred) / stall_pred if stall_pred > 0 else float("nan")
    print(f"kvplane bench attention on {name} ({s.attn.name}; served core, {args.requests} requests x "
          f"{args.context} tokens, {L} layers, offload every {args.offload_every})")
    print(f"  all-resident step {resident_ms:.3f} ms, placed step {placed_ms:.3f} ms "
          f"(plan install offloaded {delta.offloaded_layer_pages} layer-pages)")
    print(f"  bandwidth {bw:.2f} layer-pages/ms; stall measured {stall_measured:.3f} ms, "
          f"model {stall_pred:.3f} ms{' (no overlap on CPU)' if device == 'cpu' else ''}, "
          f"relative error {err:.1%}")
    path = write_result(args.out_dir, "attention", name, {
        "figure": "decode step on the served core (LayeredKVCore) with placement vs all-resident; "
                  "measured stall vs step_time_ms",
        "device": device, "attention": s.attn.name, "data_plane": "LayeredKVCore (paged layout)",
        "params": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "placement_row": row, "resident_step_ms": resident_ms, "placed_step_ms": placed_ms,
        "layer_compute_ms": comp[0], "bw_blocks_per_ms": bw, "predicted_step_ms": predicted,
        "stall_measured_ms": stall_measured, "stall_predicted_ms": stall_pred,
        "stall_relative_error": err, "staged_steps": stats.staged_steps_total,
        "overflow_steps": stats.overflow_steps_total, "fetched_layer_pages": stats.fetched_layer_pages_total,
        "host_fraction": stats.host_fraction,
    })
    print(f"result: {path}")
    return 0
