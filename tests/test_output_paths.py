"""CLI output paths are checked before any work (kvplane/output_path.py): a path whose folder
cannot be created is one line naming the flag, exit 2 -- before, the demo ran to its end (39 s)
and the simulator its runs, then lost the result in a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvplane.output_path import output_path_error

BAD = "/proc/kvplane-nope"  # /proc takes no new folders, even for root


def _kvplane(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvplane.cli", *argv], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["sim", "trace", "--n", "3", "--out", f"{BAD}/t.jsonl"], "--out"),
        (["sim", "run", "--policy", "orbitflow", "--n", "3", "--json", f"{BAD}/x.json"], "--json"),
        (["sim", "reproduce", "orbitflow-table1", "--smoke", "--out", BAD], "--out"),
        (["demo", "--json", f"{BAD}/s.json"], "--json"),
        (["demo", "--workdir", BAD], "--workdir"),
    ],
)
def test_an_output_path_that_cannot_be_created_is_refused_up_front(argv: list[str], flag: str) -> None:
    proc = _kvplane(*argv)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert f"{flag}='{BAD}" in last and "cannot create" in last, last
    assert "wrote" not in proc.stdout and "[demo]" not in proc.stdout


def test_a_writable_path_is_created_and_used(tmp_path: Path) -> None:
    """Control: a missing folder that can be created is, and the command writes there."""
    out = tmp_path / "new" / "t.jsonl"
    proc = _kvplane("sim", "trace", "--n", "3", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(out.read_text().splitlines()) >= 3


def test_the_check_names_each_problem(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    assert output_path_error(tmp_path / "a" / "b.json", "--json") is None
    assert output_path_error(tmp_path / "file" / "b.json", "--json") == (
        f"--json={str(tmp_path / 'file' / 'b.json')!r}: cannot create {str(tmp_path / 'file')!r} (File exists)"
    )
    assert output_path_error(tmp_path, "--json") == f"--json={str(tmp_path)!r} is a directory"
    assert output_path_error(tmp_path / "d", "--out", directory=True) is None


def test_a_reader_that_leaves_early_is_not_a_traceback(tmp_path: Path) -> None:
    """`kvplane plan --batch many.json | head -c 10`: the plan list outlives the reader. The CLI
    ends quietly with 141, a shell's status for a writer SIGPIPE ended (cut short, so not 0;
    was a BrokenPipeError traceback, twice, exit 1)."""
    import json

    example = json.loads((Path(__file__).resolve().parents[1] / "controlplane" / "examples" / "batch.json").read_text())
    batches = tmp_path / "many.json"
    batches.write_text(json.dumps([example] * 300))
    err_path = tmp_path / "stderr.txt"  # a file: a stderr pipe nobody reads would fill and block the child
    with err_path.open("wb") as err_file:
        proc = subprocess.Popen([sys.executable, "-m", "kvplane.cli", "plan", "--batch", str(batches)],
                                stdout=subprocess.PIPE, stderr=err_file)
        assert proc.stdout is not None
        proc.stdout.read(10)
        proc.stdout.close()
        code = proc.wait(timeout=120)
    err = err_path.read_text()
    assert code == 141, err[-2000:]
    assert "BrokenPipe" not in err and "Traceback" not in err, err[-2000:]
