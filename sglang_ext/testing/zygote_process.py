"""ZygoteProcess: a launcher forked by the launch zygote, seen as a ``subprocess.Popen``."""

from __future__ import annotations

import json
import select
import socket
import subprocess


class ZygoteProcess:
    """The part of ``subprocess.Popen`` :class:`sglang_ext.testing.server.SGLangServer` uses
    (``pid``, ``poll``, ``wait``, ``returncode``) for a launcher the zygote forked: its exit status
    arrives as one JSON line on the request's connection (:mod:`sglang_ext.testing.zygote_server`).
    The launcher leads its own process group (``os.killpg(pid, ...)`` reaches it and the SGLang
    processes it started)."""

    ZYGOTE_GONE = 255
    """Status reported when the zygote's connection closed without one (the zygote died)."""

    def __init__(self, pid: int, conn: socket.socket, args: list[str], received: bytes = b"") -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._conn = conn
        self._buf = received
        self._parse()
        if self.returncode is not None:
            conn.close()

    def _read(self, timeout: float | None) -> None:
        while self.returncode is None:
            poller = select.poll()
            poller.register(self._conn, select.POLLIN)
            if not poller.poll(None if timeout is None else int(timeout * 1000)):
                return
            chunk = self._conn.recv(4096)
            if not chunk:
                self.returncode = self.ZYGOTE_GONE
                break
            self._buf += chunk
            self._parse()
        self._conn.close()

    def _parse(self) -> None:
        if self._buf.endswith(b"\n"):
            self.returncode = int(json.loads(self._buf)["exit"])

    def poll(self) -> int | None:
        """The exit status, or None while the launcher runs."""
        if self.returncode is None:
            self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Block until the launcher exits; ``subprocess.TimeoutExpired`` after ``timeout`` s."""
        if self.returncode is None:
            self._read(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode
