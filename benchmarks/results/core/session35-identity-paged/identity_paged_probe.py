"""Boundary CPU of a steady decode step in the identity layout read through page tables (README.md
next to this file): what serves now (the journalled step, tables grown from the last step's page
lists) against what served before session 35 (every decode step took the general boundary).

Run from the repository root: ``.venv/bin/python benchmarks/results/core/session35-identity-paged/identity_paged_probe.py 2048``
(tokens a request). It drives ``kvplane bench core``'s ``CoreRun`` (32 requests, 32 layers, page
16, paged reads as the FlashInfer / Triton backends set the core) and prints the medians of its
thread CPU ms per steady step and per boundary over 30 steps, for both paths.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from sglang_ext.tools.core_bench import CoreRun, add_arguments


def main() -> None:
    tokens = sys.argv[1] if len(sys.argv) > 1 else "2048"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for fast in (True, False):
        args = parser.parse_args(["--requests", "32", "--tokens", tokens, "--layers", "32", "--paged-reads",
                                  "--budget-fraction", "0.9", "--kv-heads", "1", "--head-dim", "8"])
        pool = 32 * (32 * (int(tokens) + 76) // 16 + 64)
        run = CoreRun(args, pool, "identity")
        for _ in range(32):
            run.arrive(None)
        core = run.core
        if not fast:  # before session 35: LayeredPagedDecode offered no steady fast path in this layout
            core.prepare_decode_step = lambda *a, **k: False
        for _ in range(3):
            run.decode(None)
        for _ in range(30):
            run.decode("steady")
        step = statistics.median(x[0] for x in run.samples["steady"])
        boundary = statistics.median(x[0] for x in run.samples["boundary"])
        print(f"tokens {tokens} {'journalled + grown tables (now)' if fast else 'general boundary (before)':32s} "
              f"step {step:.2f} ms, boundary {boundary:.2f} ms, identity steps {core.identity_decode.steps}")


if __name__ == "__main__":
    main()
