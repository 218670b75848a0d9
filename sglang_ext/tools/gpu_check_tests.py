"""GpuTestRun: `kvplane gpu-check`'s first step -- every ``gpu``-marked test of the repository.

The test files that carry the marker are found by text (``pytest.mark.gpu``) and run as
``python -m pytest -m gpu <files>`` in a subprocess, so a test module that needs something the
GPU host lacks (the Helm tools, the gRPC certificates) is never collected; counts come from
pytest's JUnit XML. Files under ``tests/sglang/`` need SGLang, which the GPU host cannot have:
without an importable ``sglang`` they are listed as not run (``excluded``) rather than counted as
collection errors. Without CUDA every test skips (their ``skipif``): the CPU dry run's report.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
MARKER = "pytest.mark.gpu"
MESSAGE_CHARS = 600
SGLANG_TESTS = "sglang"
"""Subfolder of the tests whose modules import SGLang (run only where it is importable)."""


@dataclass(frozen=True)
class GpuTestSummary:
    """What the ``gpu``-marked tests did."""

    command: str
    """The pytest command line run (from the repository root)."""
    files: tuple[str, ...]
    """Test files carrying the marker."""
    passed: int
    failed: int
    skipped: int
    errors: int
    """Collection or fixture errors (and a timeout or a crash of pytest itself)."""
    elapsed_s: float
    failures: tuple[str, ...] = ()
    """``file::test: message`` of every failed or erroring test (the message cut to
    :data:`MESSAGE_CHARS`): a GPU run's log is the only place it can be read."""
    excluded: tuple[str, ...] = ()
    """Marked files not run: they need SGLang and it is not importable here."""
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class GpuTestRun:
    """Finds and runs the repository's ``gpu``-marked tests (see module docstring)."""

    def __init__(self, root: Path = REPO_ROOT, tests_dir: str = "tests", timeout_s: float = 420.0) -> None:
        self.root = root
        self.tests_dir = tests_dir
        self.timeout_s = timeout_s

    def files(self) -> list[str]:
        """Test files (relative to the root) whose text names the ``gpu`` marker."""
        found = []
        for path in sorted((self.root / self.tests_dir).rglob("test_*.py")):
            if MARKER in path.read_text(errors="replace"):
                found.append(str(path.relative_to(self.root)))
        return found

    def runnable(self) -> tuple[list[str], list[str]]:
        """(files to run, files excluded because they need SGLang and it is absent)."""
        files = self.files()
        if importlib.util.find_spec("sglang") is not None:
            return files, []
        prefix = f"{self.tests_dir}/{SGLANG_TESTS}/"
        return [f for f in files if not f.startswith(prefix)], [f for f in files if f.startswith(prefix)]

    def run(self) -> GpuTestSummary:
        return self._run_files(*self.runnable())

    def _run_files(self, files: list[str], excluded: list[str]) -> GpuTestSummary:
        with tempfile.TemporaryDirectory() as tmp:
            junit = Path(tmp) / "junit.xml"
            cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                   f"--junitxml={junit}", *files]
            shown = " ".join(["python", "-m", "pytest", "-m", "gpu", "-q", *files])
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.root), env.get("PYTHONPATH", "")) if p)
            t0 = time.perf_counter()
            if not files:
                return GpuTestSummary(shown, (), 0, 0, 0, 0, 0.0, excluded=tuple(excluded),
                                      note=f"no runnable test file names {MARKER}")
            try:
                proc = subprocess.run(cmd, cwd=self.root, env=env, capture_output=True, text=True,
                                      timeout=self.timeout_s, check=False)
            except subprocess.TimeoutExpired:
                return GpuTestSummary(shown, tuple(files), 0, 0, 0, 1, time.perf_counter() - t0,
                                      note=f"pytest ran past {self.timeout_s:.0f} s and was stopped")
            elapsed = time.perf_counter() - t0
            if not junit.exists():
                tail = (proc.stdout + proc.stderr)[-400:]
                return GpuTestSummary(shown, tuple(files), 0, 0, 0, 1, elapsed,
                                      note=f"pytest exited {proc.returncode} without a report: {tail}")
            return self._parse(junit, shown, files, excluded, elapsed, proc.returncode)

    @staticmethod
    def _parse(junit: Path, shown: str, files: list[str], excluded: list[str], elapsed: float,
               rc: int) -> GpuTestSummary:
        root = ET.parse(junit).getroot()
        suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
        total = sum(int(s.get("tests", 0)) for s in suites)
        failed = sum(int(s.get("failures", 0)) for s in suites)
        errors = sum(int(s.get("errors", 0)) for s in suites)
        skipped = sum(int(s.get("skipped", 0)) for s in suites)
        failures = tuple(
            f"{case.get('classname', '')}::{case.get('name', '')}: "
            + " ".join(bad.get("message", "").split())[:MESSAGE_CHARS]
            for case in root.iter("testcase")
            for bad in [case.find("failure") if case.find("failure") is not None else case.find("error")]
            if bad is not None
        )
        notes = [] if rc in (0, 5) else [f"pytest exit status {rc}"]
        if excluded:
            notes.append(f"not run, SGLang is not importable: {', '.join(excluded)}")
        return GpuTestSummary(shown, tuple(files), total - failed - errors - skipped, failed, skipped, errors,
                              elapsed, failures, tuple(excluded), "; ".join(notes))
