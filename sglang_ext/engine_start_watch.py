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

A failed start also leaves its zmq sockets open in this process (the tokenizer manager's, the
engine's RPC socket), in reference cycles: when the garbage collector reached them, it cleared the
context's weak set of sockets before the context's finalizer ran, whose ``term()`` then waited
forever on the still-open sockets (the caller hung in its next collection after two refused starts:
found in session 84). :meth:`EngineStartWatch.close_sockets` closes those contexts first.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import structlog

from sglang_ext import compat

logger = structlog.get_logger("kvplane.offline_engine")


class EngineStartWatch:
    """The start's ``SIGQUIT`` handler and its failure record (module docstring). Pickled with the
    ``ServerArgs`` into SGLang's subprocesses, where it is never called: its state is plain data."""

    previous: Any = None
    """This process's ``SIGQUIT`` handler before the start (``signal.getsignal``), put back after a
    failed one; not pickled (it may be any callable)."""

    def __init__(self, failure_file: str | os.PathLike[str], children: frozenset[int]) -> None:
        self.failure_file = os.fspath(failure_file)
        self.children = children  # the caller's child processes before the start: not the engine's
        self.starting = True
        self.signalled = False

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k != "previous"}

    @classmethod
    def before_start(cls, failure_file: str | os.PathLike[str]) -> EngineStartWatch:
        """A watch for a start about to begin, with this process's children and ``SIGQUIT``
        handler now (call it in the main thread, last before the start)."""
        import psutil  # installed with SGLang

        watch = cls(failure_file, frozenset(p.pid for p in psutil.Process().children()))
        watch.previous = signal.getsignal(signal.SIGQUIT)
        return watch

    def __repr__(self) -> str:  # SGLang logs the handler it installs
        return "kvplane's engine-start watch (a scheduler that fails to start raises in the caller)"

    def __call__(self, signum: int, frame: Any) -> None:
        if self.starting:
            self.signalled = True
            return
        logger.error("child_failed", detail="a child process of the engine sent SIGQUIT: stopping the process "
                     "tree, as SGLang's engine does")
        compat.resolve(compat.KILL_PROCESS_TREE.path)(os.getpid())

    def started(self) -> bool:
        """The engine is up: from now on a child's ``SIGQUIT`` gets SGLang's answer. False, still
        starting, when a child's ``SIGQUIT`` came before (SGLang's detokenizer, or a scheduler whose
        loop failed right after it was ready, exits 0 after sending it, which nothing else notices:
        the engine would hang): the start failed (:meth:`failed`)."""
        self.starting = False
        if self.signalled:
            self.starting = True
            return False
        Path(self.failure_file).unlink(missing_ok=True)
        return True

    def failure(self) -> dict[str, Any] | None:
        """The first error a scheduler wrote to :attr:`failure_file` (``type``, ``message``,
        ``kvplane``: :mod:`sglang_ext.scheduler_start_failure`), or None."""
        try:
            record = json.loads(Path(self.failure_file).read_text().splitlines()[0])
        except (OSError, IndexError, ValueError):
            return None
        return {"type": str(record.get("type", "")), "message": str(record.get("message", "")),
                "kvplane": record.get("kvplane") is True}

    def failed(self, error: BaseException, engine: Any = None) -> BaseException:
        """After the engine's start raised ``error`` (or succeeded with a child's ``SIGQUIT`` on
        record: :attr:`signalled`): the processes the start left stopped (:meth:`_stop_engine_children`),
        this process's ``SIGQUIT`` handler put back, and the exception to raise instead (``error``
        itself where no scheduler wrote its error): kvplane's refusal in a scheduler (a
        ``LaunchRefusal`` or a ``ValueError`` kvplane raised) as ``ValueError("kvplane: ...")``, as a
        refusal of the parse is raised; any other scheduler error as a ``RuntimeError`` naming it.
        The start's zmq contexts are closed (:meth:`close_sockets`: ``error``'s traceback and the
        ``engine``, where one was returned, name its endpoints). A child's ``SIGQUIT`` while this
        runs is still only recorded."""
        self._stop_engine_children()
        self.close_sockets(error, engine)
        record = self.failure()
        Path(self.failure_file).unlink(missing_ok=True)
        if self.previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGQUIT, self.previous)
        self.starting = False
        if record is None:
            return error
        if record["kvplane"] and record["type"] in ("LaunchRefusal", "ValueError"):
            message = record["message"]
            return ValueError(message if message.startswith("kvplane") else f"kvplane: {message}")
        return RuntimeError(f"the engine's scheduler failed to start: {record['type']}: {record['message']}")

    def _stop_engine_children(self) -> None:
        """SIGKILL to the start's processes (with theirs): this process's children that were not
        there before it and are SGLang's (its ``sglang::`` process titles, or still multiprocessing's
        spawn entry), not another thread's child (a ``subprocess.Popen``, say), nor the resource tracker."""
        import multiprocessing

        import psutil

        kill = compat.resolve(compat.KILL_PROCESS_TREE.path)
        for child in psutil.Process().children():
            if child.pid in self.children:
                continue
            try:
                cmdline = " ".join(child.cmdline())
                if "resource_tracker" in cmdline or not (child.name().startswith("sglang") or
                                                         cmdline.startswith("sglang::") or "spawn_main" in cmdline):
                    continue
                kill(child.pid)
            except psutil.NoSuchProcess:
                continue
        multiprocessing.active_children()  # reaps the engine's exited processes (no zombies left)

    @staticmethod
    def close_sockets(error: BaseException | None, engine: Any = None) -> int:
        """Closes, at once (linger 0), every zmq context of this process with an open socket on an
        endpoint of the failed start: the ``PortArgs`` in ``error``'s traceback (a local of
        ``Engine._launch_subprocesses``, where the start failed) and ``engine.port_args``. Returns
        how many. Its sockets are garbage, in cycles, once the start's error is gone: the collector
        would clear the context's weak set of them and then hang in the context's ``term()``
        (module docstring). Another context's sockets (on other endpoints) are left alone."""
        import zmq  # installed with SGLang

        port_args_cls = compat.resolve(compat.PORT_ARGS.path)
        found = [getattr(engine, "port_args", None)]
        traceback = error.__traceback__ if error is not None else None
        while traceback is not None:
            found += [value for value in traceback.tb_frame.f_locals.values() if isinstance(value, port_args_cls)]
            traceback = traceback.tb_next
        endpoints = {value for args in found if isinstance(args, port_args_cls)
                     for value in (getattr(args, f.name) for f in dataclasses.fields(args))
                     if isinstance(value, str) and "://" in value}
        if not endpoints:
            return 0
        contexts: dict[int, Any] = {}
        for obj in gc.get_objects():
            if not isinstance(obj, zmq.Socket) or obj.closed or obj.context is None or id(obj.context) in contexts:
                continue
            try:
                if obj.getsockopt(zmq.LAST_ENDPOINT).decode() in endpoints:
                    contexts[id(obj.context)] = obj.context
            except zmq.ZMQError:
                continue
        for context in contexts.values():
            context.destroy(linger=0)
        return len(contexts)
