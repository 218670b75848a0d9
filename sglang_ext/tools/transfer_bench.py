"""`kvplane bench transfer`: the served engine's batched block-first H2D/D2H vs one contiguous copy.

The copies measured are the ones SGLang's layered pool issues: a
:class:`~sglang_ext.dataplane.slot_kv_store.SlotKVStore` at the given shapes (CUDA: pinned
block-first host pool ``[P, L, 2, block, H, D]``, device page pool, the CUDA transfer engine's
two side streams) moves one layer of ``batch`` pages with ``store.engine.h2d`` / ``d2h`` over
``store.host_segs`` / ``store.dev_segs`` indices -- one launch, K and V segments of every page.
For each block size and batch it reports:

* ``batched_h2d_gbps`` / ``batched_d2h_gbps``: one engine launch each way;
* ``contiguous_h2d_gbps``: one pinned ``copy_`` of the same number of bytes (the ceiling);
* ``duplex_gbps``: an engine H2D and an engine D2H of disjoint pages issued together (they run on
  the engine's two streams; GPU only), and its ratio to one direction (target >= 1.5x; PCIe and
  NVLink are full duplex).

Targets (issue 4): batched H2D >= 85% of contiguous for block runs of 64+ tokens.
"""

from __future__ import annotations

import argparse

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
from sglang_ext.dataplane.slot_kv_store import SlotKVStore
from sglang_ext.dataplane.slot_store_config import SlotStoreConfig

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_device_argument(parser)
    parser.add_argument("--layers", type=int, default=8, help="layers in the host pool")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="float16", choices=sorted(DTYPES))
    parser.add_argument("--block-sizes", default="16,64,128", help="tokens per block, comma list")
    parser.add_argument("--batches", default="16,128,512", help="request-blocks per launch")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise SystemExit(f"--{name}: expected a comma list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"--{name}: values must be >= 1, got {text!r}")
    return values


def make_store(device: str, layers: int, heads: int, dim: int, dtype: torch.dtype, bs: int, batch: int) -> SlotKVStore:
    """The served store at these shapes: ``2 * batch`` host pages (H2D reads one half, the duplex
    D2H writes the other), ``2 * batch`` device pages (paged layout, as under a budget)."""
    return SlotKVStore(SlotStoreConfig(
        layers=layers, page_size=bs, kv_heads=heads, head_dim=dim, logical_pages=2 * batch + 1,
        device_pages=2 * batch, dtype=dtype, device=device,
    ))


def measure(device: str, layers: int, heads: int, dim: int, dtype: torch.dtype, bs: int, batch: int,
            repeat: int, seed: int = 0) -> dict:
    store = make_store(device, layers, heads, dim, dtype, bs, batch)
    eng = store.engine
    layer = layers // 2
    perm = np.random.default_rng(seed).permutation(np.arange(1, 2 * batch + 1))
    pages, others = perm[:batch], perm[batch:]  # duplex writes the other half: no overlap
    lay = np.full(batch, layer)
    src, dst = store.host_segs(lay, pages), store.dev_segs(np.arange(batch))
    d_src, d_dst = store.dev_segs(np.arange(batch, 2 * batch)), store.host_segs(lay, others)
    idx = [eng.index_tensor(x) for x in (src, dst, d_src, d_dst)]
    nbytes = int(src.size) * eng.segment_bytes
    elt = torch.empty((), dtype=dtype).element_size()
    flat_host = torch.empty(nbytes // elt, dtype=dtype, pin_memory=device == "cuda")
    flat_dev = torch.empty(nbytes // elt, dtype=dtype, device=device)

    def h2d() -> None:
        eng.h2d(idx[0], idx[1], host_idx=(src, dst))

    def d2h() -> None:
        eng.d2h(idx[2], idx[3], host_idx=(d_src, d_dst))

    h2d_ms = time_ms(h2d, device, repeat)
    d2h_ms = time_ms(d2h, device, repeat)
    contig = time_ms(lambda: flat_dev.copy_(flat_host, non_blocking=True), device, repeat)
    gbps = lambda ms: nbytes / ms / 1e6  # noqa: E731
    row = {
        "block_size": bs,
        "batch_blocks": batch,
        "bytes": nbytes,
        "segment_bytes": eng.segment_bytes,
        "engine": type(eng).__name__ + (f" ({eng.impl})" if hasattr(eng, "impl") else ""),
        "batched_h2d_gbps": gbps(h2d_ms),
        "batched_d2h_gbps": gbps(d2h_ms),
        "contiguous_h2d_gbps": gbps(contig),
        "batched_vs_contiguous": contig / h2d_ms,
    }
    if device == "cuda":

        def duplex() -> None:
            h2d()
            d2h()

        both = time_ms(duplex, device, repeat)
        row["duplex_gbps"] = 2 * nbytes / both / 1e6
        row["duplex_vs_one_direction"] = row["duplex_gbps"] / row["batched_h2d_gbps"]
    return row


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device, "bench transfer")
    if device is None:
        return NO_GPU_EXIT
    name = describe_device(device)
    rows = []
    print(f"kvplane bench transfer on {name} (layers={args.layers}, kv_heads={args.kv_heads}, "
          f"head_dim={args.head_dim}, {args.dtype})")
    print(f"{'block':>5} {'batch':>6} {'seg KiB':>8} {'H2D GB/s':>9} {'D2H GB/s':>9} "
          f"{'contig GB/s':>11} {'ratio':>6} {'duplex x':>8}")
    for bs in _ints(args.block_sizes, "block-sizes"):
        for batch in _ints(args.batches, "batches"):
            r = measure(device, args.layers, args.kv_heads, args.head_dim, DTYPES[args.dtype], bs, batch,
                        args.repeat, args.seed)
            rows.append(r)
            print(f"{bs:>5} {batch:>6} {r['segment_bytes'] / 1024:>8.0f} {r['batched_h2d_gbps']:>9.2f} "
                  f"{r['batched_d2h_gbps']:>9.2f} {r['contiguous_h2d_gbps']:>11.2f} "
                  f"{r['batched_vs_contiguous']:>6.2f} {r.get('duplex_vs_one_direction', float('nan')):>8.2f}")
    path = write_result(args.out_dir, "transfer", name, {
        "figure": "the served engine's batched block-first H2D/D2H (SlotKVStore.engine) vs one "
                  "contiguous pinned copy; duplex vs one direction",
        "device": device,
        "params": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "rows": rows,
    })
    print(f"result: {path}")
    return 0
