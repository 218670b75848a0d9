"""Boundary CPU of a prefill step in the paged layout (README.md next to this file).

Run from the repository root: ``.venv/bin/python benchmarks/results/core/session36-extend-boundary/extend_boundary_probe.py 16384``
(prompt tokens) ``[paged|identity]`` (layout; default paged). It drives ``kvplane bench core``'s ``CoreRun`` (32 layers, page 16, paged reads
as the FlashInfer / Triton backends set the core; ``paged``: a budget that holds 60% of the
pool; ``identity``: nothing offloaded, the CUDA default) through 10 arrivals -- each a plan and a prefill step of one request -- and prints the
median thread CPU time of ``prepare_step`` (the prefill's boundary) with the torch-native token
tables built (what every layered backend's extend built before session 36) and without them (what
the paged backends' extends build now: they read page tables through the paged-extend kernel).
On this CPU host the boundary's device ops (the page-table gather, the rows' three ops) run on
the CPU and are counted; on a GPU they are launches.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from sglang_ext.tools.core_bench import CoreRun, add_arguments


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    for token_tables in (True, False):
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        args = parser.parse_args(["--requests", "1", "--tokens", str(tokens), "--layers", "32", "--paged-reads",
                                  "--budget-fraction", "0.6", "--kv-heads", "1", "--head-dim", "8"])
        layout = sys.argv[2] if len(sys.argv) > 2 else "paged"
        run = CoreRun(args, 2 * 32 * (12 * (tokens + 76) // 16 + 64), layout)
        core = run.core
        core.token_tables = token_tables
        real, times = core.prepare_step, []

        def timed(*a, real=real, times=times, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            t0 = time.thread_time()
            out = real(*a, **k)
            times.append(time.thread_time() - t0)
            return out

        core.prepare_step = timed
        for _ in range(10):
            run.arrive(None)
        print(f"{tokens} prompt tokens, token tables {'on ' if token_tables else 'off'}: "
              f"prefill boundary {1e3 * statistics.median(times):.2f} ms (median of {len(times)})")


if __name__ == "__main__":
    main()
