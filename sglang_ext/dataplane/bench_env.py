"""Shared plumbing of the data-plane tools: device choice, machine naming, timing, results."""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path("benchmarks/results/dataplane")
NO_GPU_EXIT = 2


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cuda", "cpu"),
        help="auto = cuda if available, else refuse (exit 2); cpu runs the same code on the "
        "CPU and labels the result CPU",
    )
    parser.add_argument("--out-dir", default=str(RESULTS_DIR), help="where the JSON result goes")


def resolve_device(choice: str, tool: str) -> str | None:
    """``cuda``/``cpu``, or None after printing why (caller exits with NO_GPU_EXIT)."""
    if choice in ("auto", "cuda") and torch.cuda.is_available():
        return "cuda"
    if choice == "cpu":
        return "cpu"
    print(
        f"kvplane {tool}: no CUDA device here ({describe_device('cpu')}); this measures a GPU. "
        "Run it on a GPU host, or pass --device cpu for a CPU-labelled figure.",
        file=sys.stderr,
    )
    return None


def describe_device(device: str) -> str:
    """GPU name, or ``CPU: <model> (<n> threads)``."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU: {model} ({torch.get_num_threads()} threads)"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], Any], device: str, repeat: int, warmup: int = 2) -> float:
    """Median wall time of ``fn`` in ms (device-synchronized)."""
    for _ in range(warmup):
        fn()
    sync(device)
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return samples[len(samples) // 2]


def write_result(out_dir: str, name: str, device_name: str, payload: dict[str, Any]) -> Path:
    """Write ``payload`` (plus machine) to ``<out_dir>/<name>-<device slug>.json``."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")[:60]
    path = Path(out_dir) / f"{name}-{slug}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"machine": device_name, "torch": torch.__version__, **payload}
    path.write_text(json.dumps(body, indent=2) + "\n")
    return path
