"""The offline engine's start watch (``sglang_ext/engine_start_watch.py``) and the scheduler's
failure record (``sglang_ext/scheduler_start_failure.py``), without starting an engine (the
engine end to end: ``test_offline_engine.py``)."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_ext.device_capacity import budget_pages
from sglang_ext.engine_start_watch import EngineStartWatch
from sglang_ext.launch_refusal import LaunchRefusal, refuse_launch
from sglang_ext.scheduler_start_failure import _raised_by_kvplane, around_scheduler_init
from sglang_ext.settings import START_FAILURE_FILE_ENV

pytestmark = pytest.mark.sglang
ROOT = Path(__file__).parents[2]


def _kvplane_check() -> None:  # a ValueError kvplane raises (its innermost frame in sglang_ext)
    budget_pages(1, 16)


def _other_check() -> None:  # a ValueError raised outside kvplane
    int("not a number")


def _failed_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, init) -> BaseException:  # noqa: ANN001
    """What the watch raises after ``init`` failed in ``Scheduler.__init__``'s place."""
    path = tmp_path / "start.jsonl"
    path.touch()
    monkeypatch.setenv(START_FAILURE_FILE_ENV, str(path))
    watch = EngineStartWatch(path, frozenset())
    with pytest.raises(ValueError):
        around_scheduler_init(init)
    died = RuntimeError("Rank 0 scheduler died during initialization")
    raised = watch.failed(died)
    assert not path.exists()
    return raised


def test_kvplanes_refusal_in_a_scheduler_is_raised_as_its_value_error(tmp_path, monkeypatch):
    """A ``ValueError`` kvplane raises while the scheduler is built becomes ``ValueError("kvplane:
    ...")`` in the caller; SGLang's (or anyone else's) ``ValueError`` a ``RuntimeError`` naming it,
    not a kvplane refusal; with nothing recorded, SGLang's own error is raised as it was."""
    ours = _failed_start(tmp_path, monkeypatch, _kvplane_check)
    assert type(ours) is ValueError and str(ours) == "kvplane: --kv-gpu-budget-tokens=1 is below one page (16 tokens)"
    other = _failed_start(tmp_path, monkeypatch, _other_check)
    assert type(other) is RuntimeError and str(other) == (
        "the engine's scheduler failed to start: ValueError: invalid literal for int() with base 10: 'not a number'")
    watch, died = EngineStartWatch(tmp_path / "never-written.jsonl", frozenset()), RuntimeError("died")
    assert watch.failed(died) is died


def test_a_refusal_made_outside_the_schedulers_init_is_recorded_too(tmp_path, monkeypatch):
    """``refuse_launch`` (the hook check at ``publish``, before the scheduler is built) records its
    refusal; without the variable (``sglang.launch_server``) nothing is written."""
    path = tmp_path / "start.jsonl"
    with pytest.raises(LaunchRefusal):
        refuse_launch("--enable-layered-kv: a hook is missing")
    assert not path.exists()
    path.touch()
    monkeypatch.setenv(START_FAILURE_FILE_ENV, str(path))
    with pytest.raises(LaunchRefusal):
        refuse_launch("--enable-layered-kv: a hook is missing")
    raised = EngineStartWatch(path, frozenset()).failed(RuntimeError("died"))
    assert type(raised) is ValueError and str(raised) == "kvplane: --enable-layered-kv: a hook is missing"


def test_the_watch_travels_to_sglangs_subprocesses(tmp_path):
    """``ServerArgs`` (its ``custom_sigquit_handler`` field included) is pickled into every
    subprocess SGLang spawns: the watch must pickle."""
    watch = pickle.loads(pickle.dumps(EngineStartWatch(tmp_path / "f.jsonl", frozenset({1, 2}))))
    assert watch.children == frozenset({1, 2}) and watch.starting and watch.failure_file == str(tmp_path / "f.jsonl")


_SIGQUIT = """
import os, signal, sys
from sglang_ext.engine_start_watch import EngineStartWatch
early = EngineStartWatch(sys.argv[1], frozenset())
signal.signal(signal.SIGQUIT, early)
os.kill(os.getpid(), signal.SIGQUIT)
print("survived the start's SIGQUIT", early.signalled, "started:", early.started(), early.starting, flush=True)
watch = EngineStartWatch(sys.argv[1], frozenset())
signal.signal(signal.SIGQUIT, watch)
print("started:", watch.started(), flush=True)
os.kill(os.getpid(), signal.SIGQUIT)
print("survived SIGQUIT after the start", flush=True)
"""


def test_a_childs_sigquit_is_recorded_while_starting_and_sglangs_answer_after(tmp_path):
    """While the engine starts, a child's ``SIGQUIT`` is recorded and the process goes on, and the
    start is then not taken as done (a child that failed after the schedulers were ready: the
    engine would hang); once it has started, the process is killed, as SGLang's engine's own
    handler does."""
    proc = subprocess.run([sys.executable, "-c", _SIGQUIT, str(tmp_path / "f.jsonl")], capture_output=True,
                          text=True, timeout=120, cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "survived the start's SIGQUIT True started: False True" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "started: True" in proc.stdout, proc.stdout
    assert "after the start" not in proc.stdout and proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr)


def test_kvplanes_package_is_recognised_through_a_symlink(tmp_path):
    """A checkout reached through a symlink: an error raised in kvplane's package there is still
    kvplane's (before, only the package's own path was resolved and such a refusal became a
    ``RuntimeError``). Control: a file outside the package is not."""
    link = tmp_path / "linked_sglang_ext"
    link.symlink_to(Path(_raised_by_kvplane.__code__.co_filename).parent)

    def raised_in(path: Path) -> BaseException:
        try:
            exec(compile("raise ValueError('refused')", str(path), "exec"), {})  # noqa: S102
        except ValueError as exc:
            return exc
        raise AssertionError("not raised")

    assert _raised_by_kvplane(raised_in(link / "layered_pool.py"))
    assert not _raised_by_kvplane(raised_in(tmp_path / "layered_pool.py"))


_SOCKETS = r'''
import gc, json, os, sys, tempfile, threading
import zmq
from sglang.srt.server_args import PortArgs
from sglang_ext.engine_start_watch import EngineStartWatch

threading.Timer(8, lambda: (print("HUNG", flush=True), os._exit(3))).start()
ipc = lambda: "ipc://" + tempfile.mktemp(dir=sys.argv[2])

class Manager:  # a tokenizer manager's stand-in: the start's sockets, in a reference cycle
    pass

def launch(port_args):  # SGLang's _launch_subprocesses: PortArgs a local of the frame that fails
    manager = Manager()
    manager.me, manager.context = manager, zmq.Context(2)
    manager.pull = manager.context.socket(zmq.PULL)
    manager.pull.bind(port_args.tokenizer_ipc_name)
    manager.push = manager.context.socket(zmq.PUSH)
    manager.push.connect(port_args.scheduler_input_ipc_name)
    manager.push.send(b"never delivered")  # queued: no scheduler reads it
    raise RuntimeError("Rank 0 scheduler died during initialization")

callers = zmq.Context()  # the caller's own context, in use: left alone
kept = callers.socket(zmq.PULL)
kept.bind(ipc())
closed = 0
try:
    launch(PortArgs(tokenizer_ipc_name=ipc(), scheduler_input_ipc_name=ipc(), detokenizer_ipc_name=ipc(), nccl_port=0,
                    rpc_ipc_name=ipc(), metrics_ipc_name=ipc(), tokenizer_worker_ipc_name=None,
                    decoupled_spec_ipc_config=None))
except RuntimeError as error:
    if sys.argv[1] == "closed":
        closed = EngineStartWatch.close_sockets(error)
gc.collect()
print("RESULT", json.dumps({"closed": closed, "kept_open": not kept.closed and not callers.closed}), flush=True)
os._exit(0)
'''


def test_a_failed_starts_sockets_are_closed_so_collecting_them_cannot_hang(tmp_path):
    """A failed start's zmq sockets, left in reference cycles with a message queued: the collector
    clears the context's weak set of sockets before the context's finalizer, whose ``term()`` then
    waits forever (session 84: the caller hung after two refused starts). ``close_sockets`` closes
    the contexts with a socket on the start's endpoints (the ``PortArgs`` in the error's traceback),
    at once: the collection returns, and the caller's own context is left open. Negative control:
    without it, the same collection hangs (the script's 8 s alarm)."""
    runs = {mode: subprocess.Popen([sys.executable, "-c", _SOCKETS, mode, str(tmp_path)], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, cwd=str(ROOT),
                                   env={**os.environ, "PYTHONPATH": str(ROOT)})
            for mode in ("closed", "unclosed")}
    out = {mode: proc.communicate(timeout=120)[0] for mode, proc in runs.items()}
    assert 'RESULT {"closed": 1, "kept_open": true}' in out["closed"], out["closed"][-2000:]
    assert "HUNG" in out["unclosed"] and "RESULT" not in out["unclosed"], out["unclosed"][-2000:]
