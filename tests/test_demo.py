"""`kvplane demo`: the rendering helpers (fast) and the whole demo against real SGLang (slow)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvplane.demo import (
    SUMMARY_HEADER,
    placement_lines,
    print_summary,
    request_rows,
    summarize_stats,
)
from sglang_ext.testing.early_starts import EarlyStarts
from sglang_ext.tools.workload import RequestResult, RequestSpec

REPO = Path(__file__).resolve().parents[1]
DEMO_DEADLINE_S = 900
"""Whole-demo deadline for the test (target < 3 min on a quiet 2-core host; shared hosts are slower)."""


def _rec(step: int, running: list[str], gpu: dict[str, int], paused: list[str] = (), **kw) -> dict:
    return {
        "step": step,
        "mode": "decode",
        "step_ms": 10.0,
        "running": running,
        "paused": list(paused),
        "gpu_layers": gpu,
        "layers": 4,
        "layered_pool": True,
        "device_pages_used": 10,
        "device_pages_total": 64,
        "host_fraction": 0.5,
        "finished": [],
        **kw,
    }


def test_placement_lines_show_changes_and_count_the_rest() -> None:
    """Unchanged steps are elided (and counted); pauses and resumes are always shown."""
    recs = [
        _rec(1, ["a"], {"a": 4}),
        _rec(2, ["a"], {"a": 4}),
        _rec(3, ["a"], {"a": 2}, paused=["b"], paused_now=["b"]),
        _rec(4, ["a"], {"a": 2}, paused=["b"]),
        _rec(5, ["a", "b"], {"a": 2, "b": 4}, resumed_now=["b"]),
    ]
    lines = placement_lines(recs, max_lines=40)
    assert len(lines) == 4  # steps 1, 3, 5 + the elision count
    assert "a:4/4" in lines[0]
    assert "b:P" in lines[1] and "pause b" in lines[1]
    assert "resume b" in lines[2]
    assert "2 steps" in lines[3]


def test_summarize_stats_reports_missing_pieces() -> None:
    """No stats: a note says the scheduler hooks are not active; pauses are collected otherwise."""
    notes: list[str] = []
    pool, events = summarize_stats([], notes)
    assert pool["steps"] == 0 and events == [] and "not active" in notes[0]
    notes = []
    pool, events = summarize_stats([_rec(1, ["a"], {"a": 4}, paused_now=["b"])], notes)
    assert notes == [] and events == [{"step": 1, "what": "pause", "requests": ["b"]}]
    assert pool["peak_host_fraction"] == 0.5 and pool["device_pages_total"] == 64


def test_request_rows_attainment() -> None:
    """TBT attainment counts gaps <= 1.1 x the request's SLO; TTFT against the TTFT SLO."""
    spec = RequestSpec("s", 5, 4, stream=True, slo_tbt_ms=100.0)
    res = RequestResult(
        spec, True, None, 4, 5, 0.0, 500.0, 50.0, (50.0, 150.0, 400.0, 401.0), "abcd"
    )
    (row,) = request_rows([res], slo_tbt_ms=200.0, slo_ttft_ms=1000.0)
    assert row["ttft_met"] is True
    assert row["tbt_attainment"] == pytest.approx(2 / 3, abs=1e-3)  # 100, 250, 1 -> 2 on time
    full = RequestResult(RequestSpec("n", 5, 4, stream=False), True, None, 4, 5, 0.0, 2000.0, None)
    (row,) = request_rows([full], slo_tbt_ms=200.0, slo_ttft_ms=1000.0)
    assert row["e2e_bound_ms"] == 1600.0 and row["ttft_met"] is False


def _summary(flags: list[str]) -> dict:
    return {"model": "tiny", "device": "cpu", "launch_flags": flags, "slo_tbt_ms": 200.0, "slo_ttft_ms": 2000.0,
            "notes": [], "placement_lines": [], "events": [], "requests": [], "all_ok": True, "wall_s": 1.0,
            "pool": {"peak_device_pages_used": 1, "device_pages_total": 2, "peak_host_fraction": 0.5, "steps": 3,
                     "fallback_steps": 0}}


def test_summary_says_the_control_plane_is_embedded_and_why_paced_streams_read_tbt_p50_zero(capsys) -> None:
    """A reader of the summary learns which control plane served and that pacing's final burst is
    why TBT p50 reads ~0 ms; neither line appears when it would not be true."""
    print_summary(_summary(["--enable-layered-kv", "--kv-pacing", "on"]))
    out = capsys.readouterr().out
    assert "control plane: embedded" in out and "streams are paced" in out
    print_summary(_summary(["--enable-layered-kv", "--kv-pacing", "off", "--kv-control-plane", "cp:50051"]))
    out = capsys.readouterr().out  # negative control: a remote control plane, pacing off
    assert "control plane: embedded" not in out and "streams are paced" not in out


def _alive_serving(model_dir: Path) -> list[str]:
    """Command lines of the processes whose arguments name ``model_dir``."""
    alive = []
    for proc_dir in Path("/proc").iterdir():
        if proc_dir.name.isdigit():
            try:
                cmdline = (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(model_dir) in cmdline:
                alive.append(cmdline)
    return alive


def _stop(proc: subprocess.Popen[str]) -> None:
    """Ctrl-C, as a user stops the demo (it stops its server), then SIGKILL after 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _run_demo(work: Path, early: EarlyStarts | None = None) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """``kvplane demo --workdir WORK/w --json WORK/summary.json``, as a user runs it, and the
    processes still serving its model right after it exits (``early``: run in its environment,
    stopped if the session ends first)."""
    command = [sys.executable, "-m", "kvplane.cli", "demo", "--workdir", str(work / "w"),
               "--json", str(work / "summary.json")]
    base = os.environ if early is None else early.env
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**base, "PYTHONPATH": str(REPO)})
    if early is not None:
        early.cleanup(lambda: _stop(proc))
    try:
        out, err = proc.communicate(timeout=DEMO_DEADLINE_S)
    except subprocess.TimeoutExpired:
        _stop(proc)
        out, err = proc.communicate()
        err += f"\n(test: stopped after {DEMO_DEADLINE_S} s)"
    return subprocess.CompletedProcess(command, proc.returncode, out, err), _alive_serving(work / "w" / "model")


def early_start(early: EarlyStarts, tmp_path_factory: pytest.TempPathFactory, items: list[pytest.Item]) -> None:
    """Run the demo from the end of collection (``tests/conftest.py``): its ~50 s (a fresh SGLang
    server, the product's own command) run beside the suite's first tests; the test below reads
    its result."""
    if importlib.util.find_spec("sglang") is None or not any(i.name == _END_TO_END for i in items):
        return
    work = tmp_path_factory.mktemp("demo")
    early.submit(_END_TO_END, lambda: (work, *_run_demo(work, early)))


_END_TO_END = "test_demo_runs_end_to_end"


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.timeout(DEMO_DEADLINE_S + 60)
def test_demo_runs_end_to_end(tmp_path: Path, early_starts: EarlyStarts) -> None:
    """`kvplane demo` launches SGLang, serves the mixed workload, prints the summary, tears down
    (run from the end of collection: :func:`early_start`; here if it was not)."""
    pytest.importorskip("sglang")
    work, proc, alive = early_starts.take(_END_TO_END) or (tmp_path, *_run_demo(tmp_path))
    out_json = work / "summary.json"
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert SUMMARY_HEADER in proc.stdout
    summary = json.loads(out_json.read_text())
    assert summary["all_ok"]
    assert len(summary["requests"]) == 6
    assert all(r["completion_tokens"] > 0 for r in summary["requests"])
    assert "placements over time" in proc.stdout and "requests (TTFT/TBT" in proc.stdout
    # Every piece must be active: a note means the demo ran without the layered pool, the
    # scheduler hooks' stats or the budget flag, and showed nothing of kvplane.
    assert summary["notes"] == [], "the demo ran with kvplane inactive: " + "; ".join(summary["notes"])
    # The embedded default budget (DEFAULT_BUDGET_TOKENS) must force offloading and a pause.
    pool = summary["pool"]
    assert pool["steps"] > 0, pool
    assert pool["peak_host_fraction"] is not None and pool["peak_host_fraction"] > 0.5, (
        f"the default budget did not offload most layer-KV: {pool}"
    )
    whats = [e["what"] for e in summary["events"]]
    assert "pause" in whats and "resume" in whats, (
        f"the default budget did not pause and resume a request: events {summary['events']}"
    )
    # Torn down: no process was left serving the demo's model directory when it exited.
    assert not alive, alive


def test_a_step_short_of_its_plan_says_so_in_its_line():
    """The request columns are the plan's; a step whose plan did not fit the device yet (the
    pool's per-step ``delta.shortfall_layer_pages``) says so, so "4/4" beside "dev 0/640" is not
    a contradiction left unexplained. Control: a step with no shortfall has no such note."""
    from kvplane.demo import _step_line

    base = {"step": 35, "mode": "decode", "step_ms": 12.0, "layers": 4, "running": ["a"],
            "gpu_layers": {"a": 4}, "device_pages_used": 0, "device_pages_total": 640, "host_fraction": 1.0}
    _, line = _step_line({**base, "delta": {"shortfall_layer_pages": 2232}}, {})
    assert "short 2232 layer-pages" in line
    _, line = _step_line({**base, "delta": {"shortfall_layer_pages": 0}}, {})
    assert "short" not in line
