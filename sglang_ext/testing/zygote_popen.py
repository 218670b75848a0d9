"""ZygotePopen: start an ``mp.Process`` by forking the launch zygote's fork server.

SGLang starts its scheduler, detokenizer and ``--dp`` controller processes with
``multiprocessing``'s ``spawn`` method: each one is a fresh interpreter that imports SGLang again
(~8-17 s of CPU on a 2-core host). In a process forked by the launch zygote
(:mod:`sglang_ext.testing.zygote_server`), :func:`sglang_ext.testing.zygote_child.install_spawn`
routes those starts here instead: the process is forked from the zygote's standard-library fork
server, which imported SGLang once (not kvplane, no plugin loaded) -- the state a spawned child
has after its imports, without their cost.

What a spawned child would have that a fork-server child does not is handed over with the
process: the starting process's environment, its stdout and stderr, its process group and its
identity as the parent (:func:`sglang_ext.testing.zygote_child.adopt`, which the child runs
before the process's own target).
"""

from __future__ import annotations

import io
import os
import socket
import sys
from multiprocessing import forkserver, popen_forkserver, reduction, resource_tracker, spawn, util
from multiprocessing.context import set_spawning_popen
from typing import Any


class ZygotePopen(popen_forkserver.Popen):
    """``popen_forkserver.Popen`` against the zygote's fork server, wherever this process came
    from (the standard one would start a fork server of its own in each launcher)."""

    def __init__(self, process_obj: Any, site_dirs: tuple[str, ...] = ()) -> None:  # noqa: ANN401
        self._site_dirs = site_dirs
        super().__init__(process_obj)

    def _launch(self, process_obj: Any) -> None:  # noqa: ANN401 - a multiprocessing BaseProcess
        from sglang_ext.testing import zygote_child

        handover = {
            "parent_pid": os.getpid(),
            "pgid": os.getpgid(0),
            "env": dict(os.environ),
            "stdout": self.duplicate_for_child(sys.stdout.fileno() if sys.stdout else 1),
            "stderr": self.duplicate_for_child(sys.stderr.fileno() if sys.stderr else 2),
            "site_dirs": self._site_dirs,
        }
        target, args, kwargs = process_obj._target, process_obj._args, process_obj._kwargs
        process_obj._target = zygote_child.adopt
        process_obj._args = (handover, target, tuple(args), dict(kwargs))
        process_obj._kwargs = {}
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
            process_obj._target, process_obj._args, process_obj._kwargs = target, args, kwargs

        self.sentinel, w = _connect(self._fds)
        _parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


def _connect(fds: list[int]) -> tuple[int, int]:
    """``ForkServer.connect_to_new_process`` without its ``ensure_running`` (which in a forked
    launcher would wait on a fork server that is not its child, and in a fork-server child start
    a second server): the zygote's server, whose address and liveness pipe every process forked
    from the zygote inherits."""
    server = forkserver._forkserver
    if server._forkserver_address is None or server._forkserver_alive_fd is None:
        raise RuntimeError("no launch zygote fork server in this process")
    with socket.socket(socket.AF_UNIX) as client:
        client.connect(server._forkserver_address)
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        allfds = [child_r, child_w, server._forkserver_alive_fd, resource_tracker.getfd(), *fds]
        try:
            reduction.sendfds(client, allfds)
            return parent_r, parent_w
        except BaseException:
            os.close(parent_r)
            os.close(parent_w)
            raise
        finally:
            os.close(child_r)
            os.close(child_w)
