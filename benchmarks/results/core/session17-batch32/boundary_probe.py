"""Host time of a resident paged decode boundary at batch 32 (README.md next to this file).

Run from the repository root: ``.venv/bin/python benchmarks/results/core/session17-batch32/boundary_probe.py``.
It drives gpu-check's ``CoreCheck`` on the CPU (Llama-3-8B KV heads, 32 layers, batch 32,
staggered contexts 128-512, fp32 with a small hidden size) and prints the mean thread CPU time
of the boundary (``prepare_decode_step`` / ``prepare_step``) over 10 steps.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from sglang_ext.tools import gpu_check
from sglang_ext.tools.gpu_check_measure import CoreCheck

STEPS = 10


def main() -> None:
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    gpu_check.add_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--shapes", "llama3-8b", "--layers", "32",
                              "--context-min", "128", "--context-max", "512", "--repeat", "3"])
    config = dataclasses.replace(gpu_check.config_from_args(args, "cpu"), dtype="float32", intermediate=256,
                                 hidden=512)
    check = CoreCheck(config, "cpu", "torch")
    for _ in range(3):
        check.step()
    total = 0.0
    for _ in range(STEPS):
        check.step()
        total += check.batch.prepare_cpu_s
    core = check.batch.core
    print(f"boundary ms {total / STEPS * 1e3:.3f} advanced {core.advanced_decode_steps} opened {core.opened_advances} "
          f"builds {core.resident_builds}")


if __name__ == "__main__":
    main()
