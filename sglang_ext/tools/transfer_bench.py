"""`kvplane bench transfer`: batched block-first H2D/D2H bandwidth vs one contiguous copy.

For each block size and batch (number of request-blocks fetched for one layer), it measures:

* ``batched_h2d_gbps`` / ``batched_d2h_gbps``: the data plane's one-launch gather/scatter of the
  K and V segments of one layer from/to the block-first host pool;
* ``contiguous_h2d_gbps``: one pinned ``copy_`` of the same number of bytes (the ceiling);
* ``duplex_gbps``: H2D and D2H batches at the same time on the two streams (GPU only), and its
  ratio to one direction (target >= 1.5x; PCIe and NVLink are full duplex).

Targets (issue 4): batched H2D >= 85% of contiguous for block runs of 64+ tokens.
"""

from __future__ import annotations

import argparse

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


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise SystemExit(f"--{name}: expected a comma list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"--{name}: values must be >= 1, got {text!r}")
    return values


def measure(device: str, layers: int, heads: int, dim: int, dtype: torch.dtype, bs: int, batch: int, repeat: int) -> dict:
    seg = bs * heads * dim
    elt = torch.empty((), dtype=dtype).element_size()
    host = torch.randn(batch * 2, layers, 2, seg).to(dtype)  # block-first, 2x batch blocks
    dev = torch.zeros(2 * batch, seg, dtype=dtype, device=device)
    if device == "cuda":
        host = host.pin_memory()
    host_segs = host.view(-1, seg)
    layer = layers // 2
    perm = torch.randperm(batch * 2)
    blocks, others = perm[:batch], perm[batch:]  # duplex writes the other half: no overlap

    def segs(b: torch.Tensor) -> torch.Tensor:
        return torch.stack([(b * layers + layer) * 2, (b * layers + layer) * 2 + 1], 1).flatten()

    src = segs(blocks)
    src_other = segs(others).to(device)
    dst = torch.arange(2 * batch)
    src_d, dst_d = src.to(device), dst.to(device)
    nbytes = 2 * batch * seg * elt
    impl = "triton" if device == "cuda" else "torch"
    flat_host = torch.empty(nbytes // elt, dtype=dtype, pin_memory=device == "cuda")
    flat_dev = torch.empty(nbytes // elt, dtype=dtype, device=device)

    h2d = time_ms(lambda: copy_segments(host_segs, dev, src_d, dst_d, impl=impl), device, repeat)
    d2h = time_ms(lambda: copy_segments(dev, host_segs, dst_d, src_d, impl=impl), device, repeat)
    contig = time_ms(lambda: flat_dev.copy_(flat_host, non_blocking=True), device, repeat)
    gbps = lambda ms: nbytes / ms / 1e6  # noqa: E731
    row = {
        "block_size": bs,
        "batch_blocks": batch,
        "bytes": nbytes,
        "segment_bytes": seg * elt,
        "batched_h2d_gbps": gbps(h2d),
        "batched_d2h_gbps": gbps(d2h),
        "contiguous_h2d_gbps": gbps(contig),
        "batched_vs_contiguous": contig / h2d,
    }
    if device == "cuda":
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        dev2 = torch.zeros_like(dev)

        def duplex() -> None:
            with torch.cuda.stream(s1):
                copy_segments(host_segs, dev, src_d, dst_d, impl="triton")
            with torch.cuda.stream(s2):
                copy_segments(dev2, host_segs, dst_d, src_other, impl="triton")
            torch.cuda.current_stream().wait_stream(s1)
            torch.cuda.current_stream().wait_stream(s2)

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
            r = measure(device, args.layers, args.kv_heads, args.head_dim, DTYPES[args.dtype], bs, batch, args.repeat)
            rows.append(r)
            print(f"{bs:>5} {batch:>6} {r['segment_bytes'] / 1024:>8.0f} {r['batched_h2d_gbps']:>9.2f} "
                  f"{r['batched_d2h_gbps']:>9.2f} {r['contiguous_h2d_gbps']:>11.2f} "
                  f"{r['batched_vs_contiguous']:>6.2f} {r.get('duplex_vs_one_direction', float('nan')):>8.2f}")
    path = write_result(args.out_dir, "transfer", name, {
        "figure": "batched block-first H2D/D2H vs one contiguous pinned copy; duplex vs one direction",
        "device": device,
        "params": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "rows": rows,
    })
    print(f"result: {path}")
    return 0
