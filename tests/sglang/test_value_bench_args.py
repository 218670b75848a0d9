"""`kvplane bench value` set-up (no server): the budget and both servers' flags, the
bench_serving command, argument errors, and parsing of bench_serving's and the pool's output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_ext.tools.value_bench import (
    Budget,
    Workload,
    bench_serving_command,
    markdown,
    parse_bench_serving,
    peak_running_from_log,
    pool_stats_summary,
    server_flags,
    step_stats_summary,
)


def _flag(flags: tuple[str, ...] | list[str], name: str) -> str:
    """The value of the last occurrence of ``name`` (argparse: the last one wins)."""
    idx = len(flags) - 1 - list(reversed(flags)).index(name)
    return flags[idx + 1]


def test_budget_splits_the_same_token_layers_between_the_two_pools() -> None:
    budget = Budget(token_layers=4096, layers=4, slot_factor=3.0)
    budget.check()
    assert budget.vanilla_tokens == 1024  # every layer of a token on the device: B / L
    assert budget.slot_tokens == 3072
    assert budget.vanilla_tokens * budget.layers <= budget.token_layers
    assert budget.token_layers >= budget.slot_tokens + budget.page_size  # one layer of the slots + page


def test_slot_space_rounds_down_to_whole_pages() -> None:
    assert Budget(4096, 4, 2.5, page_size=16).slot_tokens == 2560
    assert Budget(4000, 4, 2.5, page_size=16).slot_tokens == 2496  # 2500 -> whole pages


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        (Budget(4096, 4, 4.0), "use --slot-factor <= 3.99"),  # 4096 slots + a page > 4096
        (Budget(4096, 8, 8.0), "use --slot-factor <= 7.99"),
        (Budget(4096, 4, 1.0), "--slot-factor=1 must be > 1"),
        (Budget(4, 4, 2.0), "leaves vanilla 1 tokens"),
    ],
)
def test_budget_refuses_configurations_that_would_overflow_or_buy_nothing(budget: Budget, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        budget.check()


def test_server_flags_same_budget_vanilla_stock_layered_as_users_launch() -> None:
    budget = Budget(4096, 4, 3.0)
    flags = server_flags(budget, Path("/tmp/policy.json"))
    vanilla, layered = flags["vanilla"], flags["layered"]
    assert _flag(vanilla, "--max-total-tokens") == "1024"
    assert not any(f.startswith("--kv-") or f == "--enable-layered-kv" for f in vanilla)
    assert "--disable-overlap-schedule" not in vanilla  # stock defaults
    assert "--enable-layered-kv" in layered
    assert _flag(layered, "--kv-gpu-budget-tokens") == "4096"
    assert _flag(layered, "--max-total-tokens") == "3072"
    assert _flag(layered, "--kv-policy") == "/tmp/policy.json"
    assert _flag(layered, "--kv-pacing") == "off"  # streamed ITL measures the mechanism, not pacing
    assert _flag(server_flags(budget, pacing="on")["layered"], "--kv-pacing") == "on"
    # both end with their own pool size, so it overrides the CPU recipe's --max-total-tokens
    assert vanilla[-2] == "--max-total-tokens" and layered[-2] == "--max-total-tokens"
    assert "--kv-policy" not in server_flags(budget)["layered"]


def test_layered_recompute_is_layered_plus_the_ratio() -> None:
    budget = Budget(4096, 4, 3.0)
    flags = server_flags(budget, recompute_ratio=0.25, recompute_layers=2)
    assert flags["layered-recompute"] == (*flags["layered"], "--kv-recompute-ratio", "0.25",
                                          "--kv-recompute-layers", "2")
    assert "--kv-recompute-ratio" not in flags["layered"]  # negative control
    assert server_flags(budget)["layered-recompute"][-2:] == ("--kv-recompute-ratio", "0.5")


def test_bench_serving_command_is_sglangs_client_offline_with_the_workload() -> None:
    wl = Workload(num_prompts=24, input_len=384, output_len=64, range_ratio=0.5, max_concurrency=16, seed=1)
    cmd = bench_serving_command(wl, 31234, Path("/m"), Path("/o.jsonl"), python="py")
    assert cmd[:3] == ["py", "-m", "sglang.bench_serving"]
    assert _flag(cmd, "--backend") == "sglang"
    assert _flag(cmd, "--dataset-name") == "random-ids"
    assert _flag(cmd, "--port") == "31234" and _flag(cmd, "--host") == "127.0.0.1"
    assert _flag(cmd, "--tokenizer") == "/m" and _flag(cmd, "--model") == "/m"
    assert "--tokenize-prompt" in cmd  # exact prompt lengths in tokens
    assert _flag(cmd, "--num-prompts") == "24"
    assert _flag(cmd, "--random-input-len") == "384" and _flag(cmd, "--random-output-len") == "64"
    assert _flag(cmd, "--random-range-ratio") == "0.5"
    assert _flag(cmd, "--request-rate") == "inf"
    assert _flag(cmd, "--max-concurrency") == "16"
    assert _flag(cmd, "--output-file") == "/o.jsonl"
    rated = bench_serving_command(Workload(request_rate=2.5), 1, Path("/m"), Path("/o"), python="py")
    assert _flag(rated, "--request-rate") == "2.5"


def test_workload_text_and_checks() -> None:
    text = Workload().text()
    assert "24 prompts" in text and "input 192-384" in text and "output 32-64" in text and "all at once" in text
    with pytest.raises(ValueError, match="--range-ratio=2"):
        Workload(range_ratio=2.0).check()
    with pytest.raises(ValueError, match="--max-concurrency=0"):
        Workload(max_concurrency=0).check()


BENCH_LINE = {
    "backend": "sglang",
    "server_info": {"internal_states": [{"max_total_num_tokens": 1024}], "max_total_tokens": 1024},
    "duration": 41.5,
    "completed": 24,
    "total_input_tokens": 6900,
    "total_output_tokens": 1150,
    "request_throughput": 0.578,
    "output_throughput": 27.71,
    "mean_ttft_ms": 9000.0,
    "median_ttft_ms": 8000.0,
    "p99_ttft_ms": 20000.5,
    "mean_itl_ms": 120.25,
    "median_itl_ms": 100.0,
    "p99_itl_ms": 900.0,
    "mean_e2e_latency_ms": 15000.0,
    "concurrency": 8.7,
    "max_concurrent_requests": 16,
}


def test_parse_bench_serving_takes_the_last_result_line() -> None:
    older = {**BENCH_LINE, "completed": 3}
    text = "\n".join([json.dumps(older), "not json", json.dumps(BENCH_LINE), ""])
    got = parse_bench_serving(text)
    assert got["completed"] == 24 and isinstance(got["completed"], int)
    assert got["request_throughput"] == 0.578
    assert got["output_tokens_per_s"] == 27.71
    assert (got["mean_ttft_ms"], got["median_ttft_ms"], got["p99_ttft_ms"]) == (9000.0, 8000.0, 20000.5)
    assert (got["mean_itl_ms"], got["median_itl_ms"], got["p99_itl_ms"]) == (120.25, 100.0, 900.0)
    assert got["max_total_num_tokens"] == 1024
    assert got["output_tokens"] == 1150 and got["max_concurrent_requests"] == 16


def test_parse_bench_serving_missing_fields_and_no_result() -> None:
    got = parse_bench_serving(json.dumps({"completed": 0, "mean_ttft_ms": None}))
    assert got["completed"] == 0 and got["mean_ttft_ms"] is None and got["max_total_num_tokens"] is None
    with pytest.raises(ValueError, match="no result line"):
        parse_bench_serving("")
    with pytest.raises(ValueError, match="no result line"):
        parse_bench_serving('{"error": 1}\n')


def test_pool_stats_summary_reads_overflow_and_peaks() -> None:
    lines = [
        {"source": "layered_pool", "batch_size": 2, "host_fraction": 0.1, "live_layer_pages": 100,
         "staged_steps_total": 1, "overflow_steps_total": 0, "device_pages_total": 4096,
         "fetched_layer_pages_total": 10, "h2d_bytes_total": 2_000_000_000},
        {"source": "layered_pool", "batch_size": 9, "host_fraction": 0.6, "live_layer_pages": 9000,
         "staged_steps_total": 2, "overflow_steps_total": 0, "device_pages_total": 4096,
         "fetched_layer_pages_total": 50, "h2d_bytes_total": 3_000_000_000, "recompute_tokens": 30},
    ]  # fmt: skip
    got = pool_stats_summary("\n".join(json.dumps(x) for x in lines) + "\ngarbage\n")
    assert got == {
        "forwards": 2,
        "staged_steps_total": 2,
        "overflow_steps_total": 0,
        "peak_host_fraction": 0.6,
        "peak_live_layer_pages": 9000,
        "peak_batch_size": 9,
        "device_pages_total": 4096,
        "fetched_layer_pages_total": 50,
        "h2d_gb_total": 3.0,
        "recompute_steps": 1,
        "recompute_tokens_total": 30,
    }
    assert pool_stats_summary("") is None
    steps = "\n".join(
        [
            json.dumps({"step_ms": 10.0, "paused_now": ["a", "b"], "held_total": 1, "fallback_steps": 0}),
            json.dumps({"step_ms": 30.0, "paused_now": [], "held_total": 3}),
            json.dumps({"step_ms": 20.0}),
            "x",
        ]
    )
    assert step_stats_summary(steps) == {
        "steps": 3,
        "pauses": 2,
        "admission_held_total": 3,
        "fallback_steps": 0,
        "median_step_ms": 20.0,
        "max_step_ms": 30.0,
    }
    assert step_stats_summary("")["steps"] == 0


def test_markdown_lists_both_servers_and_the_commands() -> None:
    payload = {
        "device": "CPU: Test",
        "date": "2026-01-01 00:00 UTC",
        "cpus": 2,
        "model": "tiny",
        "cpu_args": ["--device", "cpu"],
        "budget": {**Budget(4096, 4, 3.0).__dict__, "vanilla_max_total_tokens": 1024, "layered_max_total_tokens": 3072},
        "workload": {"text": Workload().text()},
        "layered_policy": {"slo_tbt_ms": 60000.0},
        "launch_commands": {"vanilla": ["python", "-m", "sglang.launch_server"], "layered": ["python", "x"]},
        "runs": [
            {"config": "vanilla", "round": 0, "metrics": parse_bench_serving(json.dumps(BENCH_LINE)),
             "load_avg_1m": 3.0, "command": ["python", "-m", "sglang.bench_serving"], "returncode": 0},
            {"config": "layered", "round": 0, "metrics": {}, "load_avg_1m": 3.0, "command": ["python"],
             "returncode": 1},
        ],
        "layered_pool": {"overflow_steps_total": 0, "forwards": 5},
        "notes": ["noisy"],
    }  # fmt: skip
    md = markdown(payload)
    assert "| vanilla | 0 | 24 | 0.578 | 27.7 |" in md
    assert "| layered | 0 | - |" in md
    assert "**0 overflow**" in md and "sglang.bench_serving" in md and "noisy" in md


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--slot-factor", "4"], "use --slot-factor <= 3.99"),
        (["--repeat", "0"], "--repeat=0 is out of range"),
        (["--range-ratio", "1.5"], "--range-ratio=1.5 is out of range"),
        (["--slo-tbt-ms", "0"], "--slo-tbt-ms=0 is out of range"),
        (["--configs", "vanilla,bogus"], "unknown ['bogus']"),
    ],
)
def test_bad_arguments_exit_2_naming_the_flag(argv: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvplane.cli", "bench", "value", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stdout


def test_peak_running_from_sglang_log_lines() -> None:
    log = "\n".join(
        [
            "[t] Prefill batch, #new-seq: 2, #new-token: 700, #cached-token: 0, token usage: 0.10, "
            "#running-req: 1, #queue-req: 20",
            "[t] Decode batch, #running-req: 3, #token: 1000, token usage: 0.98, #queue-req: 21",
            "[t] GET /health 200",
        ]
    )
    assert peak_running_from_log(log) == 3
    assert peak_running_from_log(log.replace("#new-seq: 2", "#new-seq: 4")) == 5
    assert peak_running_from_log("nothing") is None
