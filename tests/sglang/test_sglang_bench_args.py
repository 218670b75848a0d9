"""`kvplane bench sglang` set-up: presets, argument errors, the per-token overhead figure (no server)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from sglang_ext.tools.bench_workloads import model_spec, run_once, workload_text
from sglang_ext.tools.sglang_bench import ConfigResult, extra_ms_per_token, paired_overhead


def _result(name: str, tps: float) -> ConfigResult:
    return ConfigResult(name, (), 1.0, (tps,), tps, (tps,), tps, 100, 0, (0.0, 0.0), 0, None, 0)


def test_presets_are_valid_models() -> None:
    tiny, small = model_spec("tiny"), model_spec("small")
    assert small.hidden_size > tiny.hidden_size and small.num_hidden_layers > tiny.num_hidden_layers
    with pytest.raises(ValueError, match="--model='huge'"):
        model_spec("huge")


def test_workloads_are_described_and_unknown_ones_rejected() -> None:
    assert workload_text("throughput").startswith("throughput: one batched /generate of 8 prompts")
    assert "6 staggered OpenAI requests" in workload_text("mixed")
    with pytest.raises(ValueError, match="--workload='bursty'"):
        run_once(None, "bursty")


def test_extra_ms_per_token_is_the_wall_time_difference() -> None:
    by = {"vanilla": _result("vanilla", 100.0), "layered": _result("layered", 80.0)}
    assert extra_ms_per_token(by) == {"layered": 2.5}  # 12.5 ms - 10 ms a token
    assert extra_ms_per_token({"layered": _result("layered", 80.0)}) == {}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--repeat", "0"], "--repeat=0 is out of range"),
        (["--instances", "0"], "--instances=0 is out of range"),
        (["--configs", "vanilla,bogus"], "unknown ['bogus']"),
        (["--slo-tbt-ms", "-1"], "--slo-tbt-ms=-1.0 is out of range"),
    ],
)
def test_bad_arguments_exit_2_naming_the_flag(argv: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvplane.cli", "bench", "sglang", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stdout + proc.stderr


def test_unknown_model_preset_is_rejected_by_the_parser() -> None:
    from sglang_ext.tools.sglang_bench import add_arguments

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    with pytest.raises(argparse.ArgumentError):
        parser.parse_args(["--model", "huge"])


def _runs(name: str, rates: tuple[float, ...]) -> ConfigResult:
    return ConfigResult(name, (), 1.0, rates, 0.0, rates, 0.0, 100, 0, (0.0, 0.0), 0, None, 0)


def test_paired_overhead_compares_each_launch_with_its_own_vanilla_runs() -> None:
    """Launch-to-launch speed differences cancel: a 4% loss inside every launch reads as 4%
    although the second launch of both servers ran 25% faster (pooled medians would not)."""
    by = {
        "vanilla": _runs("vanilla", (100.0, 100.0, 125.0, 125.0)),
        "layered": _runs("layered", (96.0, 96.0, 120.0, 120.0)),
    }
    median_pct, per_launch = paired_overhead(by, "layered", repeat=2)
    assert per_launch == [4.0, 4.0] and median_pct == 4.0
    assert paired_overhead(by, "layered-offload", repeat=2) == (None, [])
