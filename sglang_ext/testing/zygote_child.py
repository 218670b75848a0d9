"""What runs inside the processes the launch zygote forks (:mod:`sglang_ext.testing.zygote_server`).

Two kinds:

* **A launcher** (:func:`run_launcher`): the fork of the zygote that runs
  ``python -m sglang.launch_server ARGV`` -- ``runpy`` runs the launcher module as ``__main__``
  with the request's ``sys.argv``, environment, working directory and log file, in a process group
  of its own. SGLang is already imported; its plugins are not loaded (the launcher's ``__main__``
  loads them, kvplane reading its ``KVPLANE_*`` variables then, as in a fresh launcher).
* **A process SGLang starts** (:func:`adopt`, the target :class:`ZygotePopen` wraps around the
  process's own): forked by the zygote's fork server instead of spawned. Before the process's
  target runs it takes what a spawned child would have inherited from the process that started
  it: the environment, stdout and stderr, the process group (``killpg`` of the launcher's group
  reaches it), the parent SGLang sees (``psutil.Process().parent()``: the scheduler signals its
  parent when it fails) and the parent's death (SGLang sets ``PR_SET_PDEATHSIG``, which here
  watches the fork server: a thread watches the real parent too and SIGKILLs the process when it
  exits -- once it gets the GIL, where the kernel's signal needs none; the zygote also kills the
  launcher's group when the launcher exits). The target's return runs the process's ``atexit``
  handlers, as a spawned child's interpreter exit does (a fork-server child ends in ``os._exit``).

In both, the directories a fresh interpreter would have taken from ``PYTHONPATH`` beyond the
zygote's own join ``sys.path``, and the ``sitecustomize`` in them runs (the test-only fault
injector, ``tests/sglang/fault_inject/``, is one).
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import runpy
import select
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def join_site_dirs(dirs: Sequence[str]) -> None:
    """Put ``dirs`` first on ``sys.path`` and run a ``sitecustomize.py`` found in them, as a fresh
    interpreter with them on ``PYTHONPATH`` does at start-up."""
    for d in reversed(dirs):
        if d not in sys.path:
            sys.path.insert(0, d)
    for d in dirs:
        path = os.path.join(d, "sitecustomize.py")
        if os.path.exists(path):
            spec = importlib.util.spec_from_file_location("sitecustomize", path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules["sitecustomize"] = module
            spec.loader.exec_module(module)
            break  # the interpreter imports the first one only


def install_spawn(dirs: Sequence[str]) -> None:
    """Route SGLang's ``spawn`` process starts in this process through the zygote's fork server
    (:class:`~sglang_ext.testing.zygote_popen.ZygotePopen`); ``dirs``: the site directories this
    process joined (:func:`join_site_dirs`), joined again by each process it starts."""
    from multiprocessing import context

    from sglang_ext.testing.zygote_popen import ZygotePopen

    context.SpawnProcess._Popen = staticmethod(functools.partial(ZygotePopen, site_dirs=tuple(dirs)))  # type: ignore[method-assign]


def _reseed() -> None:
    """Fresh random state, as a fresh process would have (``random`` reseeds itself after a fork;
    numpy's global generator does not)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _watch_parent(parent_pid: int) -> None:
    """Kill this process when ``parent_pid`` exits (what ``PR_SET_PDEATHSIG`` does for a child of
    its parent)."""
    try:
        pidfd = os.pidfd_open(parent_pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
        return

    def watch() -> None:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        poller.poll()
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="zygote-parent-watch", daemon=True).start()


def _present_parent(parent_pid: int) -> None:
    """``psutil.Process().parent()`` in this process answers the process that started it."""
    import psutil

    real = psutil.Process.parent
    me = os.getpid()

    def parent(self: psutil.Process) -> psutil.Process | None:
        if self.pid == me:
            return psutil.Process(parent_pid)
        return real(self)

    psutil.Process.parent = parent  # type: ignore[method-assign]


def adopt(handover: Mapping[str, Any], target: Callable[..., Any], args: tuple, kwargs: dict) -> Any:  # noqa: ANN401
    """Run ``target(*args, **kwargs)`` in a fork-server child as if it had been spawned by the
    process that started it (``handover``: :meth:`ZygotePopen._launch`)."""
    from multiprocessing import forkserver

    fds = forkserver.get_inherited_fds()
    os.dup2(fds[handover["stdout"]], 1)
    os.dup2(fds[handover["stderr"]], 2)
    os.environ.clear()
    os.environ.update(handover["env"])
    try:
        os.setpgid(0, handover["pgid"])
    except OSError:
        pass  # the group is gone: the launcher is exiting, and the watch below ends this process
    _watch_parent(handover["parent_pid"])
    _present_parent(handover["parent_pid"])
    _reseed()
    join_site_dirs(handover["site_dirs"])
    install_spawn(handover["site_dirs"])
    try:
        return target(*args, **kwargs)
    finally:
        atexit._run_exitfuncs()


def run_launcher(request: Mapping[str, Any], base_path: Sequence[str]) -> int:
    """Run ``python -m sglang.launch_server`` in this (freshly forked) process; return its exit
    status. ``request``: ``argv``, ``env``, ``cwd``, ``log`` and ``site_dirs`` (the ``PYTHONPATH``
    directories beyond the zygote's); ``base_path``: the zygote's ``sys.path``."""
    from sglang_ext import compat

    os.setpgid(0, 0)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:] = list(base_path)
    _reseed()
    join_site_dirs(request["site_dirs"])
    install_spawn(request["site_dirs"])
    sys.argv = [compat.LAUNCH_SERVER.path, *request["argv"]]
    # runpy's warning that the module is imported already: true here by design, absent from a
    # fresh launcher's log
    warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package",
                            category=RuntimeWarning)
    try:
        runpy.run_module(compat.LAUNCH_SERVER.path, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)  # what the interpreter prints for sys.exit("text")
    except BaseException:  # noqa: BLE001 - reported like an uncaught exception in a launcher
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # the interpreter's exit (the zygote's fork ends in os._exit)
    sys.stdout.flush()
    sys.stderr.flush()
    return code
