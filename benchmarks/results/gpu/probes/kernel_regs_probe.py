"""Registers and shared memory of kvplane's Triton copy kernels for an H100 / H200 (sm_90a),
compiled offline (no GPU): Triton's own compiler and its bundled ptxas (`ptxas -v`).

Why: gpu-check's timing events saw ~1 ms of a half-offloaded step's ~217 ms transfer stall
(session 23, run 13): the layers' kernels waited for the persistent copy programs (then 2 per
SM) to leave the SMs, and nothing overlapped (runs 14-16 confirmed it; the default is now 8
programs in all). Usage (repo root):

    .venv/bin/python benchmarks/results/gpu/probes/kernel_regs_probe.py
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import kernels.block_copy as bc

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
REGS_PER_SM, WARPS_PER_SM, SMEM_PER_SM = 65536, 64, 228 * 1024


def ptxas_regs(ptx: str) -> int:
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True, check=True)
    return int(re.findall(r"Used (\d+) registers", out.stderr + out.stdout)[-1])


def compile_kernel(lazy, signature: dict[str, str], constexprs: dict[str, int], warps: int):  # noqa: ANN001, ANN201
    src = ASTSource(fn=triton.jit(lazy.fn), signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
                    constexprs=constexprs)
    return triton.compile(src, target=TARGET, options={"num_warps": warps})


def main() -> None:
    copy_sig = {"src_ptr": "*i64", "dst_ptr": "*i64", "src_idx_ptr": "*i64", "dst_idx_ptr": "*i64", "n": "i32",
                "programs": "i32"}
    fetch_sig = {"host_ptr": "*i64", "dev_ptr": "*i64", "flat_ptr": "*i32", "stage_ptr": "*i32",
                 "map_row_ptr": "*i32", "reqs_ptr": "*i32", "starts_ptr": "*i32", "counts_ptr": "*i32",
                 "work": "i32", "host_base": "i32", "host_stride": "i32", "dev_v": "i32", "max_pages": "i32",
                 "programs": "i32"}
    seg = 4096  # int64 words of a 32 KiB segment (Llama-3-8B shapes, page 16)
    block = min(bc.COPY_BLOCK_ELEMS, seg)
    threads = 32 * bc.COPY_WARPS
    print(f"triton {triton.__version__}, sm_90a; per SM: {REGS_PER_SM} registers, {WARPS_PER_SM} warps, "
          f"{SMEM_PER_SM // 1024} KiB shared memory; a copy program: {bc.COPY_WARPS} warps; default launch "
          f"{bc.DEFAULT_PROGRAMS} programs (until session 23: 2 per SM)")
    for name, lazy, sig in (("copy_segments", bc._copy_segments_kernel, copy_sig),
                            ("fetch_pages", bc._fetch_pages_kernel, fetch_sig)):
        k = compile_kernel(lazy, sig, {"SEG": seg, "BLOCK": block}, bc.COPY_WARPS)
        regs = ptxas_regs(k.asm["ptx"])
        per_program = regs * threads
        print(f"{name}: {regs} registers/thread x {threads} threads = {per_program} registers a program "
              f"({per_program / REGS_PER_SM:.0%} of an SM), {k.metadata.shared} B shared memory; 2 per SM "
              f"took {2 * per_program / REGS_PER_SM:.0%} of every SM's registers")

if __name__ == "__main__":
    main()
