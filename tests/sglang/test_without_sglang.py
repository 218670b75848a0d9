"""Without SGLang only the tests that need it are skipped (issue 13).

A pytest subprocess runs with ``sys.modules["sglang"] = None`` (a ``-p`` plugin, so importing
SGLang fails as if it were not installed): the pure modules below must still be collected, the
modules importing SGLang at module level are skipped (not errors), and tests marked ``sglang``
are skipped at set-up, before any server fixture starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent.relative_to(REPO)
PURE = (
    "test_admission",
    "test_args",
    "test_control_client",
    "test_hooks",
    "test_layer_timing",
    "test_layered_decode_graph",
    "test_logs",
    "test_overhead_meter",
    "test_pacing",
    "test_sglang_bench_args",
    "test_tiny_model",
)
"""Modules that never import SGLang: they must run where it is not installed."""
NEEDS_SGLANG_AT_IMPORT = ("test_layered_pool", "test_layered_pool_paged", "test_layered_pool_harness", "test_kernel_extend",
                          "test_layered_pool_memory")
"""Modules importing ``sglang_ext.layered_pool`` (which subclasses SGLang's pool) at module level."""


def _pytest_without_sglang(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "kvplane_no_sglang.py").write_text('import sys\nsys.modules["sglang"] = None\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "kvplane_no_sglang", "-p", "no:cacheprovider", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_pure_modules_are_collected_without_sglang(tmp_path: Path) -> None:
    proc = _pytest_without_sglang(tmp_path, "--collect-only", "-q", "-rs", str(HERE))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for name in PURE:
        assert f"{HERE / name}.py::" in out, f"{name} was not collected without SGLang:\n{out[-4000:]}"
    for name in NEEDS_SGLANG_AT_IMPORT:  # skipped at import (rc 0: no collection error)
        assert f"{HERE / name}.py::" not in out, f"{name} was collected without SGLang"
    assert "could not import 'sglang'" in out, out[-4000:]


def test_sglang_marked_tests_skip_before_their_fixtures(tmp_path: Path) -> None:
    """The server tests skip with the reason, without building the model or starting a server."""
    proc = _pytest_without_sglang(
        tmp_path, "-q", "-rs", str(HERE / "test_vanilla_server.py"), str(HERE / "test_launch_validation.py")
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "needs SGLang (the [sglang] extra), not installed" in out
    assert " skipped" in out and " passed" not in out and " failed" not in out, out[-4000:]


@pytest.mark.parametrize("name", PURE)
def test_pure_module_is_not_marked_sglang(name: str) -> None:
    """The ``sglang`` marker means "needs SGLang": a pure module must not carry it."""
    text = (REPO / HERE / f"{name}.py").read_text()
    assert "mark.sglang" not in text
