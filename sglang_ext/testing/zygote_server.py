"""The launch zygote: one process that imports SGLang once and forks SGLang servers from it.

``python -m sglang_ext.testing.zygote_server SOCKET`` (started by
:class:`sglang_ext.testing.launch_zygote.LaunchZygote`). A fresh SGLang server on a 2-core host
spends most of its start-up importing SGLang: ~9 s of CPU in the launcher, then again in each
process it spawns (scheduler, detokenizer: ~17 s each when they import side by side), 30-50 s of
wall time per server before it loads a model. A test session starts ~30 of them.

The zygote imports the launcher's modules and the spawned processes' entry modules
(:data:`sglang_ext.compat.surface_testing.ZYGOTE_PRELOAD`) -- no plugin is loaded, kvplane is
not imported -- and starts the standard library's fork server with the same modules preloaded.
Then, for each request on ``SOCKET`` (one JSON line: ``argv``, ``env``, ``cwd``, ``log``,
``site_dirs``; or ``{"query": "modules"}``, answered with the modules it imported), it forks a
launcher (:func:`sglang_ext.testing.zygote_child.run_launcher`) in a
process group of its own, answers ``{"pid": PID}`` and, when that launcher exits,
``{"exit": STATUS}`` on the same connection, after killing what is left of its process group
(a fresh launcher's ``kill_process_tree`` does that on its way out; here SGLang's processes are
the fork server's children, which the launcher's own process tree does not hold). The launcher's SGLang processes are forked by the
fork server (:class:`sglang_ext.testing.zygote_popen.ZygotePopen`). The zygote is
single-threaded (a fork of a threaded process may inherit a held lock) and exits when its stdin
reaches end of file, killing the process groups of the launchers still running.

What a server forked this way does not exercise is the interpreter start-up itself; the
servers that need it (another interpreter, an environment variable SGLang or torch reads at
import) start as fresh processes (:meth:`LaunchZygote.why_not`), and so does one layered server
on purpose (``tests/sglang/test_layered_server.py``). Shared by all the session's servers: the
zygote's multiprocessing resource tracker (leaked semaphores are reported in ``zygote.log`` at
the end) and its authentication key. A fork-server child unpickles its process and re-runs the
launcher module as ``__mp_main__`` (as a spawned child does) before it adopts its starter's
environment and output: an error that early is in ``zygote.log``.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import selectors
import signal
import socket
import sys
import threading
import time
from multiprocessing import forkserver

REQUEST_TIMEOUT_S = 10.0
"""A client that connects and sends no whole request line within this is dropped (the loop
serves one connection at a time)."""


def _preload() -> None:
    """Import SGLang here and in the fork server (side by side: the server starts first), and
    return once both have (a first process forked by the server has run)."""
    from sglang_ext.compat.surface_testing import ZYGOTE_PRELOAD

    multiprocessing.set_forkserver_preload(list(ZYGOTE_PRELOAD))
    forkserver.ensure_running()
    for name in ZYGOTE_PRELOAD:
        importlib.import_module(name)
    probe = multiprocessing.get_context("forkserver").Process(target=os.getpid)
    probe.start()
    probe.join()
    print(f"imported in {time.process_time():.1f} s of CPU; fork server probe exited with {probe.exitcode}", flush=True)


def _read_request(conn: socket.socket) -> dict:
    conn.settimeout(REQUEST_TIMEOUT_S)
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("request cut short")
        data += chunk
    return json.loads(data)


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall((json.dumps(message) + "\n").encode())
    except OSError:
        pass  # the client went away: the launcher runs on, its group is killed at exit


def main(argv: list[str]) -> int:
    """Serve launch requests on ``argv[1]`` until stdin closes."""
    from sglang_ext.testing.zygote_child import run_launcher

    path = argv[1]
    _preload()
    base_path = list(sys.path)
    if threading.active_count() != 1:  # a fork copies held locks, not the threads that hold them
        raise RuntimeError(f"the zygote must be single-threaded to fork: {threading.enumerate()}")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the socket appears once it accepts
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "listener")
    selector.register(0, selectors.EVENT_READ, "stdin")
    launchers: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, connection)
    print(f"zygote {os.getpid()} ready on {path}", flush=True)
    while True:
        for key, _ in selector.select():
            if key.data == "stdin":
                if not os.read(0, 4096):
                    for pid, _conn in launchers.values():
                        try:
                            os.killpg(pid, signal.SIGKILL)
                        except (ProcessLookupError, PermissionError):
                            pass
                    return 0
            elif key.data == "listener":
                conn, _ = listener.accept()
                try:
                    request = _read_request(conn)
                except (OSError, ValueError) as exc:  # a timeout is an OSError
                    _send(conn, {"error": f"bad request: {exc}"})
                    conn.close()
                    continue
                if request.get("query") == "modules":  # what the zygote has imported (tests)
                    _send(conn, {"modules": sorted(sys.modules)})
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:  # nothing of the zygote's loop runs on in the launcher, whatever fails
                        for fd in (listener.fileno(), conn.fileno(), *launchers,
                                   *(c.fileno() for _, c in launchers.values())):
                            os.close(fd)
                        selector.close()
                        code = run_launcher(request, base_path)
                    finally:
                        os._exit(code)
                try:
                    os.setpgid(pid, pid)  # also done by the child: whichever runs first
                except OSError:
                    pass
                pidfd = os.pidfd_open(pid)
                launchers[pidfd] = (pid, conn)
                selector.register(pidfd, selectors.EVENT_READ, "launcher")
                _send(conn, {"pid": pid})
            else:
                pidfd = key.fd
                pid, conn = launchers.pop(pidfd)
                selector.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                try:  # what the launcher's kill_process_tree does to its SGLang processes
                    os.killpg(pid, signal.SIGKILL)  # (children of the fork server: it finds none)
                except (ProcessLookupError, PermissionError):
                    pass
                _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
