"""How a served decode step's boundary was taken, under SGLang's own client (README.md next to this file).

Run from the repository root: ``.venv/bin/python benchmarks/results/core/session37-turnover/served_turnover_probe.py``
``[budget tokens|identity]``. It builds the tests' tiny model, starts one layered SGLang server
on the CPU recipe (``--enable-layered-kv``, torch-native attention; with a budget: the paged
layout, ``--kv-gpu-budget-tokens``), sends it ``python -m sglang.bench_serving --dataset-name
random-ids`` (64 prompts of 32-96 tokens, 16-48 output tokens, 16 requests/s, at most 16 in
flight: requests join and finish all the time) and prints the in-process meter's counts of
boundaries: ``prepare_steady_decode`` (the decode path: no request's slots read) and
``prepare_general`` (prefills, and decode steps the decode path declined), with the pool's
``decode_turnovers_total``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from sglang_ext.settings import OVERHEAD_FILE_ENV, POOL_STATS_FILE_ENV
from sglang_ext.testing.jsonl import read_jsonl
from sglang_ext.testing.server import SGLangServer
from sglang_ext.testing.tiny_model import TinyModelSpec, build_tiny_model


def main() -> None:
    layout = sys.argv[1] if len(sys.argv) > 1 else "1536"
    root = Path(tempfile.mkdtemp(prefix="served-turnover-"))
    model = build_tiny_model(root / "model", TinyModelSpec())
    flags = ["--dtype", "float32", "--enable-layered-kv"]
    if layout != "identity":
        flags += ["--kv-gpu-budget-tokens", layout]
    env = {OVERHEAD_FILE_ENV: str(root / "overhead.json"), POOL_STATS_FILE_ENV: str(root / "stats.jsonl")}
    with SGLangServer(model, log_path=root / "server.log", extra_args=flags, env=env) as server:
        cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--host", "127.0.0.1",
               "--port", str(server.port), "--model", str(model), "--tokenizer", str(model),
               "--dataset-name", "random-ids", "--tokenize-prompt", "--num-prompts", "64",
               "--random-input-len", "64", "--random-output-len", "32", "--random-range-ratio", "0.5",
               "--request-rate", "16", "--max-concurrency", "16", "--seed", "1", "--warmup-requests", "0",
               "--disable-tqdm", "--output-file", str(root / "bench.jsonl")]
        subprocess.run(cmd, check=True, capture_output=True, timeout=900)
        # the meter writes every 64 steps: one more request flushes the last counts
        server.post("/generate", {"text": "flush", "sampling_params": {"max_new_tokens": 70, "temperature": 0.0,
                                                                       "ignore_eos": True}})
    counts = json.loads((root / "overhead.json").read_text())["counts"]
    last = read_jsonl(root / "stats.jsonl")[-1]
    bench = [json.loads(line) for line in (root / "bench.jsonl").read_text().splitlines() if line.strip()][-1]
    print(f"layout {layout}: boundaries {counts}; decode_turnovers_total {last.get('decode_turnovers_total')}; "
          f"completed {bench.get('completed')}, output tok/s {bench.get('output_throughput', 0):.1f}; logs {root}")


if __name__ == "__main__":
    main()
