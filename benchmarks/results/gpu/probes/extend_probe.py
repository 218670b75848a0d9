"""Session 65's GPU run 22: which launch of the paged extend kernel serves prefill fastest.

Run 21 (`kvplane gpu-check`, H200) measured the paged extend (``kernels/paged_extend.py``, the
layered paged backends' prefill) at 3.82 ms for one layer of gpu-check's mixed batch against
1.47 ms for SGLang's torch-native loop it replaced (2.6x, target <= 1) and 1.37 ms for SDPA on
gathered K/V: 91 TFLOP/s. Here every launch form below runs on that batch (``ExtendCheck``'s
inputs at Llama-3-8B heads) and on four whole 4K prompts, each checked against the fp32 reference
(bf16 tolerance 0.03) and timed (median of 20 device-synchronised runs after 3):

- tiles ``BLOCK_M x BLOCK_N``, ``num_warps``, ``num_stages``;
- ``PACK_GQA``: the q heads of a kv head packed into the rows (one K/V load per group);
- ``SPLIT_MASK``: tiles wholly below the diagonal skip the causal mask.

Usage on a GPU host (``cpu`` as a last argument: the same code at toy sizes under the Triton
interpreter, every launch form checked for error only)::

    python3 benchmarks/results/gpu/probes/extend_probe.py [cpu]

Results: ``extend-probe-run22-*``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

from kernels.paged_extend import paged_extend_ref, paged_extend_triton
from sglang_ext.dataplane.bench_env import time_ms
from sglang_ext.tools.gpu_check_config import LLAMA3_8B, SMALL
from sglang_ext.tools.gpu_check_extend import CPU_PROMPTS, CUDA_PROMPTS, ExtendCheck, causal_flops

CPU = sys.argv[-1] == "cpu"
if CPU:
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = "cpu" if CPU else "cuda"
CONFIG = SMALL if CPU else LLAMA3_8B
BATCHES = {"gpu-check": CPU_PROMPTS if CPU else CUDA_PROMPTS,
           "4x4K": ((0, 24),) * 2 if CPU else ((0, 4096),) * 4}
TILES = [(64, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 3), (128, 64, 8, 2),
         (128, 32, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 128, 4, 2)]
if CPU:
    TILES = [(16, 32, 4, 1), (32, 16, 4, 1)]
LAUNCHES = [{"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s, "PACK_GQA": pack, "SPLIT_MASK": True}
            for pack in (False, True) for m, n, w, s in TILES]
LAUNCHES += [{**LAUNCHES[0], "SPLIT_MASK": False}, {**LAUNCHES[-1 if CPU else len(TILES) + 4], "SPLIT_MASK": False}]


def name(launch: dict[str, object]) -> str:
    return (f"{launch['BLOCK_M']}x{launch['BLOCK_N']} w{launch['num_warps']} s{launch['num_stages']}"
            f"{' pack' if launch['PACK_GQA'] else ''}{'' if launch['SPLIT_MASK'] else ' mask-all'}")


def main() -> None:
    out_dir = os.environ.get("OUT", "/tmp")
    device = "cpu" if CPU else torch.cuda.get_device_name()
    result: dict[str, object] = {"device": device, "torch": torch.__version__, "batches": {}}
    for label, prompts in BATCHES.items():
        check = ExtendCheck(CONFIG, DEVICE, prompts=prompts)
        t = check._inputs()
        max_q = max(e for _, e in prompts)
        want = paged_extend_ref(**t).float()
        flops = causal_flops(prompts, CONFIG.q_heads, CONFIG.head_dim)
        rows: list[dict[str, object]] = []
        entry: dict[str, object] = {"prompts": [list(p) for p in prompts], "launches": rows}
        if not CPU:
            loop, dense = check._loops(t)
            entry["torch_loop_ms"] = time_ms(loop, DEVICE, 20, warmup=3)
            entry["dense_sdpa_ms"] = time_ms(dense, DEVICE, 20, warmup=3)
            entry["default_ms"] = time_ms(lambda t=t, max_q=max_q: paged_extend_triton(**t, max_q_len=max_q), DEVICE, 20, warmup=3)
            print(f"[{label}] torch loop {entry['torch_loop_ms']:.3f} ms, SDPA alone {entry['dense_sdpa_ms']:.3f} ms, "
                  f"default launch {entry['default_ms']:.3f} ms", flush=True)
        for launch in LAUNCHES:
            row: dict[str, object] = {"launch": name(launch), **launch}
            try:
                got = paged_extend_triton(**t, max_q_len=max_q, launch=launch)
                row["max_abs_err"] = float((got.float() - want).abs().max())
                if not CPU:
                    ms = time_ms(lambda launch=launch, t=t, max_q=max_q: paged_extend_triton(**t, max_q_len=max_q, launch=launch),
                                 DEVICE, 20, warmup=3)
                    row.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12,
                               vs_torch_loop=ms / float(entry["torch_loop_ms"]))  # type: ignore[arg-type]
            except Exception as exc:  # noqa: BLE001 -- a launch that does not compile is a finding
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                traceback.print_exc()
            rows.append(row)
            print(f"[{label}] {row['launch']:28s} " + (f"{row['ms']:.3f} ms {row['tflops']:.0f} TFLOP/s "
                  f"x{row['vs_torch_loop']:.2f} loop " if "ms" in row else "") +
                  (f"err {row['max_abs_err']:.4f}" if "max_abs_err" in row else str(row.get("error"))), flush=True)
        result["batches"][label] = entry  # type: ignore[index]
    slug = "cpu" if CPU else device.lower().replace(" ", "-")
    with open(os.path.join(out_dir, f"extend-probe-run22-{slug}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
