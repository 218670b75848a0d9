"""A layered offline engine's start, watched so that a scheduler's failed start is an exception in
the caller's process, not its end (:func:`sglang_ext.offline_engine.layered_engine`).

SGLang's ``Engine``, started in the main thread, answers a child's ``SIGQUIT`` (a scheduler that
fails to start sends one to its parent: ``run_scheduler_process``) by killing its own process tree,
the caller's process included (``launch_phase_sigquit_handler``, ``kill_process_tree(os.getpid())``).
A launch that kvplane refuses in the scheduler process (a check that needs the slot space SGLang
sizes there: ``--kv-recompute-ratio`` with every layer on the device, say) then ended the user's
Python process with SIGKILL (found in session 84).

:class:`EngineStartWatch` is the engine's ``custom_sigquit_handler`` (a ``ServerArgs`` field, which
``Engine`` installs instead of its own): while the engine starts, a child's ``SIGQUIT`` is recorded
and nothing else, so SGLang's wait for the schedulers raises its ``RuntimeError`` that one died;
:meth:`failed` then stops the processes that start left behind and names the scheduler's own error,
which the scheduler wrote to :attr:`failure_file` (``KVPLANE_START_FAILURE_FILE``:
:mod:`sglang_ext.scheduler_start_failure`). Once the engine has started, a child's ``SIGQUIT`` gets
SGLang's answer (the engine's process tree killed), as without kvplane.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import structlog

from sglang_ext import compat

logger = structlog.get_logger("kvplane.offline_engine")


class EngineStartWatch:
    """The start's ``SIGQUIT`` handler and its failure record (module docstring). Pickled with the
    ``ServerArgs`` into SGLang's subprocesses, where it is never called: its state is plain data."""

    def __init__(self, failure_file: str | os.PathLike[str], children: frozenset[int]) -> None:
        self.failure_file = os.fspath(failure_file)
        self.children = children  # the caller's child processes before the start: not the engine's
        self.starting = True
        self.signalled = False

    @classmethod
    def before_start(cls, failure_file: str | os.PathLike[str]) -> EngineStartWatch:
        """A watch for a start about to begin, with this process's children now."""
        import psutil  # installed with SGLang

        return cls(failure_file, frozenset(p.pid for p in psutil.Process().children()))

    def __repr__(self) -> str:  # SGLang logs the handler it installs
        return "kvplane's engine-start watch (a scheduler that fails to start raises in the caller)"

    def __call__(self, signum: int, frame: Any) -> None:
        if self.starting:
            self.signalled = True
            return
        logger.error("child_failed", detail="a child process of the engine sent SIGQUIT: stopping the process "
                     "tree, as SGLang's engine does")
        compat.resolve(compat.KILL_PROCESS_TREE.path)(os.getpid())

    def started(self) -> None:
        """The engine is up: from now on a child's ``SIGQUIT`` gets SGLang's answer."""
        self.starting = False
        Path(self.failure_file).unlink(missing_ok=True)

    def failure(self) -> dict[str, Any] | None:
        """The first error a scheduler wrote to :attr:`failure_file` (``type``, ``message``,
        ``kvplane``: :mod:`sglang_ext.scheduler_start_failure`), or None."""
        try:
            record = json.loads(Path(self.failure_file).read_text().splitlines()[0])
        except (OSError, IndexError, ValueError):
            return None
        return {"type": str(record.get("type", "")), "message": str(record.get("message", "")),
                "kvplane": record.get("kvplane") is True}

    def failed(self, error: BaseException) -> BaseException:
        """After the engine's start raised ``error``: the processes the start left (new children of
        this process, SGLang's resource tracker aside) stopped, and the exception to raise instead
        (``error`` itself where no scheduler wrote its error): kvplane's refusal in a scheduler (a
        ``LaunchRefusal`` or a ``ValueError`` kvplane raised) as ``ValueError("kvplane: ...")``, as a
        refusal of the parse is raised; any other scheduler error as a ``RuntimeError`` naming it."""
        self.starting = False
        self._stop_new_children()
        record = self.failure()
        Path(self.failure_file).unlink(missing_ok=True)
        if record is None:
            return error
        if record["kvplane"] and record["type"] in ("LaunchRefusal", "ValueError"):
            message = record["message"]
            return ValueError(message if message.startswith("kvplane") else f"kvplane: {message}")
        return RuntimeError(f"the engine's scheduler failed to start: {record['type']}: {record['message']}")

    def _stop_new_children(self) -> None:
        import multiprocessing

        import psutil

        kill = compat.resolve(compat.KILL_PROCESS_TREE.path)
        for child in psutil.Process().children():
            if child.pid in self.children:
                continue
            try:
                if any("resource_tracker" in part for part in child.cmdline()):
                    continue  # multiprocessing's, shared with the rest of this process
                kill(child.pid)
            except psutil.NoSuchProcess:
                continue
        multiprocessing.active_children()  # reaps the engine's exited processes (no zombies left)
