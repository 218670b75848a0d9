"""`kvplane bench pacing`, its pure parts (no server, not timed): the client-side figures from
fixed per-request ITL lists, reading bench_serving's details, the settings' checks, the servers'
flags, the client command and the report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from sglang_ext.tools.pacing_bench import (
    HEAVY,
    LIGHT,
    REPLAY,
    PacingBenchConfig,
    PacingRun,
    add_arguments,
    chosen_configs,
    client_command,
    config_from_args,
    pooled_figures,
    server_flags,
)
from sglang_ext.tools.pacing_figures import (
    PacingFigures,
    completed_requests,
    last_record,
    percentile,
    replay_paced,
)
from sglang_ext.tools.pacing_report import markdown, stats_slice_summary
from sglang_ext.tools.value_bench import Workload

SLO_MS = 200.0

UNPACED = [0.015] * 9 + [0.900]
"""An unpaced stream (seconds): 9 gaps of 15 ms, then a 900 ms stall (a pause)."""
PACED = [0.200] * 4 + [0.0002] * 6
"""The same stream paced at 200 ms: 4 gaps of one SLO, then the finish burst (0.2 ms apart)."""


def _flag(flags: tuple[str, ...] | list[str], name: str) -> str:
    idx = len(flags) - 1 - list(reversed(flags)).index(name)
    return flags[idx + 1]


def test_percentile_interpolates_linearly_like_numpy() -> None:
    """percentile() is numpy.percentile's default (linear between order statistics)."""
    np = pytest.importorskip("numpy")
    data = [5.0, 1.0, 4.0, 2.0, 100.0, 3.0, 0.5]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(data, q) == pytest.approx(float(np.percentile(data, q)))
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="q: 101"):
        percentile(data, 101)


def test_figures_of_an_unpaced_stream_with_a_stall() -> None:
    """Percentiles, attainment, burst and longest gap of fixed lists, in ms."""
    fig = PacingFigures.from_lists([UNPACED, [0.010, 0.010]], [0.05, 0.07], SLO_MS)
    assert (fig.requests, fig.gaps) == (2, 12)
    assert fig.itl_p50_ms == 15.0
    assert fig.itl_max_ms == 900.0
    # 12 sorted gaps: 10, 10, 15 x 9, 900; p99 sits between 15 and 900 at 0.89 of the way
    assert fig.itl_p99_ms == pytest.approx(15 + 0.89 * 885, abs=0.01)
    assert fig.gap_attainment == round(11 / 12, 4)
    # request 1 has 9/10 gaps within the SLO (exactly 90%: met), request 2 all
    assert fig.request_attainment == 1.0
    assert fig.burst_fraction == 0.0
    assert (fig.longest_gap_p50_ms, fig.longest_gap_max_ms) == (455.0, 900.0)
    assert (fig.ttft_p50_ms, fig.ttft_p99_ms) == (60.0, 69.8)


def test_figures_of_a_paced_stream_and_the_negative_controls() -> None:
    """A gap exactly at the SLO is within it; one gap more over the SLO flips a request's verdict."""
    paced = PacingFigures.from_lists([PACED], [0.05], SLO_MS)
    assert paced.gap_attainment == 1.0 and paced.request_attainment == 1.0
    # gaps a few ms over the SLO (client-side jitter) miss it but are within the tolerance
    jittered = PacingFigures.from_lists([[0.203, 0.197, 0.203, 0.197, 0.215]], [0.05], SLO_MS)
    assert jittered.gap_attainment == 0.4 and jittered.gap_attainment_tolerant == 0.8
    assert paced.burst_fraction == 0.6
    assert paced.longest_gap_max_ms == 200.0
    # negative control 1: the same gaps judged at a tighter SLO are not within it
    tight = PacingFigures.from_lists([PACED], [0.05], 150.0)
    assert tight.gap_attainment == 0.6 and tight.request_attainment == 0.0
    # negative control 2: two stalls instead of one -> 8/10 gaps within, the request misses
    two_stalls = PacingFigures.from_lists([[0.015] * 8 + [0.900, 0.900]], [0.05], SLO_MS)
    assert two_stalls.gap_attainment == 0.8 and two_stalls.request_attainment == 0.0
    # negative control 3: the pooled figures differ between the paced and the unpaced stream
    unpaced = PacingFigures.from_lists([UNPACED], [0.05], SLO_MS)
    assert unpaced.itl_p50_ms == 15.0 and paced.itl_p50_ms == 0.2
    assert unpaced.longest_gap_max_ms == 900.0 != paced.longest_gap_max_ms


def test_replay_paced_hides_a_stall_behind_the_deposit_and_bursts_the_rest() -> None:
    """The unpaced stream replayed through the token deposit: one token per SLO while tokens are
    held (the 900 ms stall is covered), the rest at the finish; with an SLO shorter than every
    gap nothing is held and the gaps are unchanged (negative control)."""
    got = [round(1e3 * g, 6) for g in replay_paced(UNPACED, SLO_MS)]
    # arrivals at 0, 15, ..., 135 and 1035 ms: deliveries at 0, 200, ..., 1000, then 1035 x 5
    assert got == [200.0] * 5 + [35.0] + [0.0] * 4
    assert len(got) == len(UNPACED)
    fig = PacingFigures.from_lists([replay_paced(UNPACED, SLO_MS)], [0.05], SLO_MS)
    assert fig.longest_gap_max_ms == 200.0 and fig.burst_fraction == 0.4
    unchanged = replay_paced(UNPACED, 1.0)
    assert unchanged == pytest.approx(UNPACED)
    assert replay_paced([], SLO_MS) == []


def test_figures_edge_cases() -> None:
    """No gaps (one-token requests) meet the SLO; no requests give None; bad inputs refused."""
    one_token = PacingFigures.from_lists([[], []], [0.01, 0.02], SLO_MS)
    assert one_token.gaps == 0 and one_token.request_attainment == 1.0 and one_token.itl_p99_ms is None
    empty = PacingFigures.from_lists([], [], SLO_MS)
    assert empty.requests == 0 and empty.request_attainment is None and empty.ttft_p50_ms is None
    with pytest.raises(ValueError, match="itls_s has 1 requests, ttfts_s 0"):
        PacingFigures.from_lists([[0.1]], [], SLO_MS)
    with pytest.raises(ValueError, match="slo_tbt_ms: 0.0"):
        PacingFigures.from_lists([], [], 0.0)


def test_completed_requests_skips_failed_ones_and_needs_details() -> None:
    """Failed requests (error text, TTFT 0) are left out; a summary-only record is refused."""
    record = {
        "completed": 2,
        "itls": [[0.01, 0.02], [], [0.03]],
        "ttfts": [0.1, 0.0, 0.2],
        "errors": ["", "Bad Request: kvplane_slo_tbt_ms", ""],
    }
    itls, ttfts = completed_requests(record)
    assert itls == [[0.01, 0.02], [0.03]] and ttfts == [0.1, 0.2]
    with pytest.raises(ValueError, match="--output-details"):
        completed_requests({"completed": 2})
    text = "\n".join([json.dumps({**record, "completed": 1}), "garbage", json.dumps(record), ""])
    assert last_record(text)["completed"] == 2
    with pytest.raises(ValueError, match="no result line"):
        last_record("x\n")


def _config(**kw) -> PacingBenchConfig:
    base = {"slo_tbt_ms": SLO_MS, "budget_token_layers": 1024, "light": LIGHT, "heavy": HEAVY}
    return PacingBenchConfig(**{**base, **kw})


def test_config_defaults_are_light_within_and_heavy_beyond_the_budget() -> None:
    cfg = _config()
    assert cfg.peak_token_layers(LIGHT) == 2 * 64 * 4 <= 1024 // 2  # well inside the budget
    assert cfg.peak_token_layers(HEAVY) == 8 * 272 * 4 > 8 * 1024
    # negative control: 100 prompts at most 2 at a time still hold only 2 streams' KV
    assert cfg.peak_token_layers(Workload(num_prompts=100, input_len=10, output_len=10, max_concurrency=2)) == 160
    assert cfg.workload("heavy") is HEAVY
    with pytest.raises(ValueError, match="load: 'medium'"):
        cfg.workload("medium")


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"budget_token_layers": 1023}, "light load needs up to 512 token-layers .* > half of"),
        ({"budget_token_layers": 20000}, "heavy load needs at most 8704 token-layers"),
        ({"slo_tbt_ms": 0.0}, "--slo-tbt-ms=0 is out of range"),
        ({"repeat": 0}, "--repeat=0 is out of range"),
        ({"light": Workload(max_concurrency=0)}, "--max-concurrency=0"),
    ],
)
def test_config_refuses_loads_that_would_not_measure_what_they_say(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(**kw)


def test_arguments_default_to_the_policy_slo_and_the_named_loads() -> None:
    """Without --slo-tbt-ms the layered servers run the policy's default SLO."""
    from controlplane.policy import Policy

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(parser.parse_args([]))
    assert cfg.slo_tbt_ms == Policy().slo_tbt_ms
    assert cfg.light == LIGHT and cfg.heavy == HEAVY
    cfg = config_from_args(parser.parse_args(["--slo-tbt-ms", "50", "--heavy-concurrency", "6"]))
    assert cfg.slo_tbt_ms == 50.0 and cfg.heavy.max_concurrency == 6 and cfg.light == LIGHT
    assert chosen_configs("pacing-off, vanilla") == ["vanilla", "pacing-off"]
    with pytest.raises(ValueError, match="unknown \\['paced'\\]"):
        chosen_configs("paced")


def test_server_flags_differ_only_in_pacing() -> None:
    flags = server_flags(2048, Path("/p.json"))
    on, off, vanilla = flags["pacing-on"], flags["pacing-off"], flags["vanilla"]
    assert _flag(on, "--kv-pacing") == "on" and _flag(off, "--kv-pacing") == "off"
    assert [f for f in on if f != "on"] == [f for f in off if f != "off"]
    assert _flag(on, "--kv-gpu-budget-tokens") == "2048" and _flag(on, "--kv-policy") == "/p.json"
    assert not any(f.startswith("--kv-") or f == "--enable-layered-kv" for f in vanilla)


def test_client_command_asks_for_per_request_details() -> None:
    cmd = client_command(LIGHT, 4321, Path("/m"), Path("/o.jsonl"))
    assert cmd[1:3] == ["-m", "sglang.bench_serving"]
    assert "--output-details" in cmd and _flag(cmd, "--output-file") == "/o.jsonl"
    assert _flag(cmd, "--backend") == "sglang" and _flag(cmd, "--dataset-name") == "random-ids"
    assert _flag(cmd, "--max-concurrency") == "2" and _flag(cmd, "--port") == "4321"


def _run(config: str, load: str, itls: list[list[float]], steps: dict | None = None) -> PacingRun:
    fig = PacingFigures.from_lists(itls, [0.05] * len(itls), SLO_MS)
    return PacingRun(
        config, load, 0, fig.__dict__, {"duration_s": 12.5}, steps, (3.0, 4.0), ("python",), 0,
        tuple(tuple(i) for i in itls), tuple([0.05] * len(itls)),
    )  # fmt: skip


def test_pooled_figures_and_the_report() -> None:
    """Rounds pool per load and server; the report has both loads' tables and the machine."""
    steps = stats_slice_summary(
        "\n".join(
            [
                json.dumps({"step_ms": 10.0, "paused_now": ["a"], "host_fraction": 0.5}),
                json.dumps({"step_ms": 30.0, "paused_now": [], "host_fraction": 0.75}),
                "not json",
            ]
        )
    )
    assert steps["pauses"] == 1 and steps["peak_host_fraction"] == 0.75 and steps["steps"] == 2
    runs = [
        _run("pacing-on", "heavy", [PACED], steps),
        _run("pacing-on", "heavy", [PACED]),
        _run("pacing-off", "heavy", [UNPACED], steps),
        _run("vanilla", "light", [[0.015] * 5]),
    ]
    pooled = pooled_figures(runs, SLO_MS)
    assert pooled["heavy"]["pacing-on"]["requests"] == 2
    assert pooled["heavy"]["pacing-off"]["itl_max_ms"] == 900.0
    assert pooled["heavy"][REPLAY]["itl_max_ms"] == 200.0  # the off run's stall, paced away
    assert set(pooled["light"]) == {"vanilla"}  # no pacing-off run there: no replay either
    cfg = _config()
    payload = {
        "machine": {"device": "CPU: Test", "cpus": 2, "load_avg_start": [3.0, 2.0, 1.0],
                    "load_avg_end": [4.0, 2.5, 1.5], "wall_s": 500.0},
        "date": "2026-01-01 00:00 UTC",
        "model": "tiny",
        "cpu_args": ["--device", "cpu"],
        "settings": {
            "slo_tbt_ms": SLO_MS, "layered_policy": {"slo_tbt_ms": SLO_MS}, "budget_token_layers": 2048,
            "repeat": 1,
            "loads": {name: {"text": w.text(), "peak_token_layers": cfg.peak_token_layers(w)}
                      for name, w in (("light", LIGHT), ("heavy", HEAVY))},
        },
        "figures": pooled,
        "runs": [{k: v for k, v in r.__dict__.items() if k not in ("itls_s", "ttfts_s")} for r in runs],
        "notes": ["Shared host."],
    }  # fmt: skip
    md = markdown(payload)
    assert "## light load" in md and "## heavy load" in md
    assert "3.00/2.00/1.00 at the start and 4.00/2.50/1.50 at the end" in md
    heavy_on = next(line for line in md.splitlines() if line.startswith("| pacing-on |"))
    assert "| 60.0% |" in heavy_on and "| 75.0% |" in heavy_on  # burst share, peak host KV
    assert "gaps <= SLO +5%" in md
    assert "| 12.5/12.5 | 1 |" in heavy_on  # both rounds' client seconds, then the pauses
    heavy_off = next(line for line in md.splitlines() if line.startswith("| pacing-off |"))
    assert "| 900.0 |" in heavy_off and "| 60.0% |" not in heavy_off
    assert "- Shared host." in md
