"""Static checks that keep main landable: ruff on the repo, mypy on the control plane."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str:
    path = Path(sys.executable).with_name(name)
    found = str(path) if path.exists() else shutil.which(name)
    assert found, f"{name} is not installed: run `make setup`"
    return found


def test_ruff_clean():
    """`ruff check .` reports nothing."""
    out = subprocess.run([_tool("ruff"), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_clean_on_controlplane():
    """`mypy` (configured in pyproject for controlplane/) reports no errors."""
    out = subprocess.run(
        [_tool("mypy")], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout + out.stderr


MAX_MODULE_LINES = 499
"""STYLE: modules under 500 lines (generated protobuf stubs excepted)."""


def _long_modules(root: Path) -> list[str]:
    skip = {".venv", ".git", "build", "node_modules"}
    out = []
    for path in root.rglob("*.py"):
        if skip.intersection(path.relative_to(root).parts) or path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        n = len(path.read_text(errors="replace").splitlines())
        if n > MAX_MODULE_LINES:
            out.append(f"{path.relative_to(root)}: {n} lines")
    return out


def test_modules_stay_under_500_lines(tmp_path):
    """Every Python module of the repo is under 500 lines; a 500-line module is caught (negative control)."""
    assert _long_modules(ROOT) == []
    (tmp_path / "big.py").write_text("x = 1\n" * 500)
    (tmp_path / "ok.py").write_text("x = 1\n" * 499)
    assert _long_modules(tmp_path) == ["big.py: 500 lines"]
