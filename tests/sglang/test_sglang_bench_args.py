"""`kvplane bench sglang` set-up: presets, configurations (stock baseline, no-overlap), argument
errors, the overhead figures and their rendering (no server)."""

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


def test_baseline_is_stock_sglang_and_no_overlap_is_measured_beside_it(tmp_path) -> None:
    """vanilla keeps SGLang's defaults (overlap scheduler on); vanilla-no-overlap adds only
    --disable-overlap-schedule; the layered configs launch as users do (the flag implies it)."""
    from sglang_ext.tools.sglang_bench import DEFAULT_CONFIGS, asks_overlap, config_flags
    from sglang_ext.tools.workload import SHARED_HOST_ARGS

    flags = config_flags(2048, tmp_path / "policy.json")
    assert set(DEFAULT_CONFIGS) | {"layered-overlap"} == set(flags)  # layered-overlap: opt-in only
    assert flags["vanilla"] == flags["vanilla-b"] == SHARED_HOST_ARGS
    assert flags["vanilla-no-overlap"] == (*SHARED_HOST_ARGS, "--disable-overlap-schedule")
    assert flags["layered"][: len(SHARED_HOST_ARGS)] == SHARED_HOST_ARGS
    assert "--enable-layered-kv" in flags["layered"]
    assert "--disable-overlap-schedule" not in flags["layered"]  # implied by the plugin
    assert flags["layered-offload"][-2:] == ("--kv-gpu-budget-tokens", "2048")
    assert {name: asks_overlap(f) for name, f in flags.items()} == {
        "vanilla": True,
        "vanilla-b": True,
        "vanilla-no-overlap": False,
        "layered": False,
        "layered-offload": False,
        "layered-overlap": True,  # --kv-overlap-schedule on
    }
    assert not asks_overlap((*flags["layered-overlap"][:-1], "off"))  # negative control


def test_configs_default_and_subset(tmp_path) -> None:
    from sglang_ext.tools.sglang_bench import _configs, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    default = _configs(parser.parse_args([]), tmp_path / "p.json")
    assert list(default) == ["vanilla", "vanilla-b", "vanilla-no-overlap", "layered", "layered-offload"]
    chosen = _configs(parser.parse_args(["--configs", "layered, vanilla-no-overlap"]), tmp_path / "p.json")
    assert list(chosen) == ["layered", "vanilla-no-overlap"]


def test_overlap_scheduler_is_read_from_server_info() -> None:
    """``/server_info`` holds the resolved args (nested groups in 0.5.23): the flag is found anywhere."""
    from sglang_ext.tools.sglang_bench import overlap_schedule_of

    assert overlap_schedule_of({"disable_overlap_schedule": False}) is True
    assert overlap_schedule_of({"schedule": {"page_size": 1, "disable_overlap_schedule": True}}) is False
    assert overlap_schedule_of({"internal_states": [{"x": 1}], "args": [{"disable_overlap_schedule": False}]}) is True
    assert overlap_schedule_of({"version": "0.5.23"}) is None


def test_comparisons_split_the_whole_cost_into_overlap_and_plugin() -> None:
    """layered vs stock vanilla is the whole cost; vanilla-no-overlap vs vanilla the overlap
    scheduler forced off; layered vs vanilla-no-overlap the plugin on the same loop."""
    from sglang_ext.tools.sglang_bench import _markdown, comparisons

    by = {
        "vanilla": _runs("vanilla", (100.0, 100.0, 120.0, 120.0)),
        "vanilla-no-overlap": _runs("vanilla-no-overlap", (90.0, 90.0, 108.0, 108.0)),
        "layered": _runs("layered", (81.0, 81.0, 97.2, 97.2)),
    }
    got = {c["key"]: c for c in comparisons(by, repeat=2)}
    assert set(got) == {"overhead", "no_overlap", "plugin"}  # no offload or A/A configs measured
    assert (got["overhead"]["config"], got["overhead"]["against"]) == ("layered", "vanilla")
    assert got["overhead"]["paired_per_launch_pct"] == [19.0, 19.0]
    assert got["no_overlap"]["paired_pct"] == 10.0
    assert (got["plugin"]["against"], got["plugin"]["paired_pct"]) == ("vanilla-no-overlap", 10.0)
    payload = {
        "device": "CPU: test", "date": "today", "model": "tiny", "workload": "throughput",
        "repeat": 2, "instances": 2, "cpu_args": ["--device", "cpu"], "cpus": 2,
        "layered_policy": {}, "baseline": "vanilla: stock SGLang.", "overhead_target_pct": 5.0,
        "results": [
            {**_runs(n, (1.0,)).__dict__, "overlap_schedule": n == "vanilla"} for n in by
        ],
        "comparisons": list(got.values()),
        "notes": ["Noisy host."],
    }
    md = _markdown(payload)
    assert "Baseline vanilla: stock SGLang." in md and "| overlap scheduler |" in md
    assert "| vanilla | `` | on |" in md and "| vanilla-no-overlap | `` | off |" in md
    assert "**+19.0%** paired (per launch +19.0%, +19.0%; target <= 5%)" in md and "Noisy host." in md


def test_aa_noise_note_states_the_spread() -> None:
    from sglang_ext.tools.sglang_bench import aa_noise_note, comparisons

    by = {"vanilla": _runs("vanilla", (100.0, 100.0)), "vanilla-b": _runs("vanilla-b", (97.0, 108.0))}
    note = aa_noise_note(comparisons(by, repeat=1))
    assert note is not None and "up to 8.0%" in note and "+/-8.0%" in note
    assert aa_noise_note(comparisons({"vanilla": by["vanilla"]}, repeat=1)) is None


def test_share_beyond_the_kv_copy_scales_by_the_parts() -> None:
    """4% of the step at 0.4 ms a step, 0.1 of it the layers' KV copies: 3% beyond them; a
    launch without a kv_write part keeps its whole share (negative control)."""
    from dataclasses import replace

    base = _result("layered", 100.0)
    got = replace(base, kvplane_share_pct=(4.0, 2.0), kvplane_ms_per_step=(0.4, 0.2),
                  kvplane_parts_ms_per_step=({"kv_write": 0.1, "end_step": 0.3}, {"end_step": 0.2}))
    assert got.share_beyond_kv_copy_pct == (3.0, 2.0)
    assert base.share_beyond_kv_copy_pct == ()
