"""`tools/gpu_host_check.sh` (what a lent GPU host runs, README "GPU check") and `make gpu-wheels`'s
wheel list: the script runs gpu-check with its deadline and leaves the report and the log in $OUT
(the CPU dry run here); the wheels it installs are the versions the project pins."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *args: str, wrap: tuple[str, ...] = (), **env: str) -> subprocess.CompletedProcess[str]:
    """The script with ``args`` (under ``wrap``, e.g. a `timeout` command line), its output in tmp_path/out."""
    wheels = tmp_path / "no-wheels"  # the host's .whl/ holds cp312 wheels; none are needed here
    wheels.mkdir(exist_ok=True)
    full = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "WHEELS_DIR": str(wheels), **env}
    return subprocess.run([*wrap, "bash", str(ROOT / "tools" / "gpu_host_check.sh"), *args], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=300, check=False)


def test_the_host_script_runs_the_check_and_leaves_report_and_log(tmp_path):
    done = _run(tmp_path, "--device", "cpu", "--skip-tests", "--repeat", "1", DEADLINE_S="300")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    out = tmp_path / "out"
    [report] = out.glob("gpu-check-cpu-*.json")
    body = json.loads(report.read_text())
    assert body["status"] == "PASS" and "--deadline-s 300" in body["command"]
    assert "overall PASS" in (out / "gpu-check.log").read_text()


def test_the_host_script_passes_on_the_checks_exit_status(tmp_path):
    """Control: a check that fails (here: stopped by its deadline at once) fails the script, and
    the report of what it measured is still there."""
    done = _run(tmp_path, "--device", "cpu", "--skip-tests", "--repeat", "1", DEADLINE_S="0.05")
    assert done.returncode == 1, done.stdout[-2000:]
    [report] = (tmp_path / "out").glob("gpu-check-cpu-*.json")
    assert any(f["key"] == "deadline" for f in json.loads(report.read_text())["figures"])


def test_a_sigterm_to_the_whole_group_still_leaves_the_report(tmp_path):
    """What a host's command limit does: `timeout` sends SIGTERM to the script's process group
    (tee included) mid-run; the check stops, writes its report and log, and the script exits
    with the check's status (1)."""
    done = _run(tmp_path, "--device", "cpu", "--skip-tests", "--repeat", "400",
                wrap=("timeout", "--preserve-status", "-k", "60", "8"), DEADLINE_S="600")
    assert done.returncode == 1, (done.returncode, done.stdout[-1500:], done.stderr[-1500:])
    out = tmp_path / "out"
    [report] = out.glob("gpu-check-cpu-*.json")
    figures = {f["key"]: f for f in json.loads(report.read_text())["figures"]}
    assert figures["deadline"]["note"].startswith("stopped by signal SIGTERM"), figures["deadline"]
    assert "stopped by signal SIGTERM" in (out / "gpu-check.log").read_text()


def test_gpu_wheels_are_the_pinned_versions():
    makefile = (ROOT / "Makefile").read_text()
    wheels = re.search(r"^GPU_WHEELS := (.+)$", makefile, re.M)
    assert wheels is not None
    pins = dict(line.split("==", 1) for line in (ROOT / "requirements" / "constraints.txt").read_text().splitlines()
                if "==" in line)
    got = dict(w.split("==", 1) for w in wheels.group(1).split())
    assert got and all(pins.get(name) == version for name, version in got.items()), (got, pins)
    assert {"mip", "structlog", "flashinfer-python"} <= set(got)
