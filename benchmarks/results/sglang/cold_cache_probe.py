"""A handful of NumPy calls, warm and after cache-evicting work (session 19, meter-session19-amd-epyc.md).

Run: ``.venv/bin/python benchmarks/results/sglang/cold_cache_probe.py``. Prints the median time
of the same few NumPy calls (a broadcast add, a ``fromiter``, a ``max``) when nothing runs between
them, after a 64 MiB sweep, and after a small torch forward -- what kvplane's bookkeeping between
two forwards meets inside a server. This host: 3.5 / 38.5 / 49.3 us.
"""

from __future__ import annotations

import time

import numpy as np
import torch


def main() -> None:
    torch.set_num_threads(1)
    big = np.zeros(64 * 1024 * 1024 // 8)
    pages = np.arange(64, dtype=np.int64) * 3
    base = (np.arange(4, dtype=np.int64) * 6000)[:, None]

    def ops() -> None:
        _ = base + pages[None, :]
        np.fromiter(iter(pages.tolist()), dtype=np.int64, count=64)
        big[:10].max()

    for mode in ("warm", "after a 64 MiB sweep", "after a small torch forward"):
        samples = []
        for _ in range(300):
            if mode.startswith("after a 64"):
                big += 1.0
            elif mode.startswith("after a small"):
                x = torch.randn(256, 256)
                for _ in range(30):
                    x = torch.nn.functional.silu(x @ x.T * 0.01)
            t0 = time.perf_counter()
            ops()
            samples.append(time.perf_counter() - t0)
        print(f"{mode}: median {np.median(samples) * 1e6:.1f} us")


if __name__ == "__main__":
    main()
