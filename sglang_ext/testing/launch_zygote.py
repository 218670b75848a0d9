"""LaunchZygote: start SGLang servers by forking one process that imported SGLang once.

Test-harness only (the suite's servers; benchmarks and the demo start fresh processes). Usage::

    zygote = LaunchZygote(tmp / "zygote").start()
    server = SGLangServer(model_dir, log_path=..., zygote=zygote).start()
    ...
    zygote.close()

What the zygote does and why: :mod:`sglang_ext.testing.zygote_server`. A server whose launch it
cannot reproduce starts as a fresh process: :meth:`LaunchZygote.why_not` says which and why.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sglang_ext.testing.zygote_process import ZygoteProcess

FREE_VARIABLES: tuple[str, ...] = (
    "KVPLANE_", "TRITON_INTERPRET", "PROMETHEUS_MULTIPROC_DIR", "SGLANG_CPU_OMP_THREADS_BIND",
    "SGLANG_NCCL_SO_PATH", "PYTEST_CURRENT_TEST", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
)
"""Environment variables (names, or prefixes ending in ``_``) a zygote-forked server may set
differently from the zygote, because nothing the zygote imported has read them yet: kvplane
(``KVPLANE_*``) and its Triton kernels, which ``TRITON_INTERPRET`` decides about when they are
defined, are imported after the fork (SGLang's own Triton kernels, defined in the zygote, stay
compiled ones, those of the model modules it pre-imports included: SGLang runs none of them on a
CPU, its platform declares no Triton -- a compiled kernel launched there would fail on the missing
driver, and the suite's ``TRITON_INTERPRET=1`` servers serve), ``prometheus_client``
(``PROMETHEUS_MULTIPROC_DIR``) too, and SGLang reads the two
``SGLANG_*`` ones when it binds threads and loads NCCL, at run time
(``tests/sglang/test_launch_zygote.py`` checks the imports); pytest's ``PYTEST_CURRENT_TEST``
(set around each test) nothing reads, and torch sets ``_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR``
itself in a process that loads a compiled inductor library, before each load. Any other difference --
``OMP_NUM_THREADS`` (OpenMP reads it when torch loads), other ``SGLANG_*`` variables -- needs a
fresh interpreter."""


class ZygoteError(RuntimeError):
    """The zygote failed to start or to fork a launcher; the message carries its log tail."""


@dataclass
class LaunchZygote:
    """A running :mod:`~sglang_ext.testing.zygote_server` and the environment it imported under."""

    root: Path
    """Directory for its socket and its log (``zygote.log``)."""
    python: str = sys.executable
    """Interpreter it runs (a server asking for another one starts fresh)."""
    start_timeout_s: float = 300.0
    """Deadline for its imports."""
    _proc: subprocess.Popen | None = None
    _env: dict[str, str] = field(default_factory=dict)

    @property
    def socket_path(self) -> Path:
        return self.root / "zygote.sock"

    @property
    def log_path(self) -> Path:
        return self.root / "zygote.log"

    def start(self) -> LaunchZygote:
        """Start the zygote (its imports run in the background: :meth:`launch` waits for them)."""
        if self._proc is not None:
            raise ZygoteError("zygote already started")
        self.root.mkdir(parents=True, exist_ok=True)
        self.socket_path.unlink(missing_ok=True)  # a stale one would refuse connections
        self._env = dict(os.environ)
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                [self.python, "-m", "sglang_ext.testing.zygote_server", str(self.socket_path)],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=self._env,
                start_new_session=True,
            )
        return self

    def why_not(self, env: Mapping[str, str], python: str) -> str | None:
        """Why a server with environment ``env`` run by ``python`` cannot be forked from this
        zygote (None: it can)."""
        if self._proc is None or self._proc.poll() is not None:
            return "the launch zygote is not running"
        if python != self.python:
            return f"interpreter {python} is not the zygote's {self.python}"
        for name in sorted(set(env) | set(self._env)):
            if env.get(name) == self._env.get(name) or name == "PYTHONPATH":
                continue
            if not any(name == free or (free.endswith("_") and name.startswith(free)) for free in FREE_VARIABLES):
                return f"environment variable {name} differs from the zygote's (may be read at import)"
        if self._site_dirs(env) is None:
            return "PYTHONPATH does not end with the zygote's"
        return None

    def _site_dirs(self, env: Mapping[str, str]) -> list[str] | None:
        """``env``'s ``PYTHONPATH`` entries before the zygote's (None: it does not end with them)."""
        want = [d for d in env.get("PYTHONPATH", "").split(os.pathsep) if d]
        base = [d for d in self._env.get("PYTHONPATH", "").split(os.pathsep) if d]
        if base and want[-len(base):] != base:
            return None
        return want[: len(want) - len(base)]

    def wait_ready(self) -> None:
        """Wait until the zygote has imported SGLang and listens (``start`` does not wait)."""
        deadline = time.monotonic() + self.start_timeout_s
        assert self._proc is not None
        while not self.socket_path.exists():
            if self._proc.poll() is not None:
                raise ZygoteError(f"zygote exited with {self._proc.returncode}\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise ZygoteError(f"zygote not ready within {self.start_timeout_s} s\n{self.log_tail()}")
            time.sleep(0.1)

    def launch(self, argv: Sequence[str], env: Mapping[str, str], log_path: Path, cwd: str) -> ZygoteProcess:
        """Fork ``python -m sglang.launch_server ARGV`` (``argv`` without the interpreter and the
        module) with ``env`` in ``cwd``, its stdout and stderr in ``log_path``."""
        reason = self.why_not(env, self.python)
        if reason is not None:
            raise ZygoteError(reason)
        self.wait_ready()
        request = {"argv": list(argv), "env": dict(env), "cwd": cwd, "log": str(log_path),
                   "site_dirs": self._site_dirs(env)}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        answer, rest = self._ask(request, conn)
        if "pid" not in answer:
            conn.close()
            raise ZygoteError(f"zygote refused the launch: {answer}")
        return ZygoteProcess(int(answer["pid"]), conn, list(argv), rest)

    def _ask(self, request: Mapping[str, object], conn: socket.socket | None = None) -> tuple[dict, bytes]:
        """Send one request line; return the first answer line and what came after it (``conn``
        stays open for more)."""
        own = conn is None
        conn = conn or socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(str(self.socket_path))
            conn.sendall((json.dumps(request) + "\n").encode())
            reply = b""
            while b"\n" not in reply:
                chunk = conn.recv(1 << 16)
                if not chunk:
                    raise ZygoteError(f"zygote closed the connection\n{self.log_tail()}")
                reply += chunk
        except BaseException:
            conn.close()
            raise
        if own:
            conn.close()
        line, _, rest = reply.partition(b"\n")
        return json.loads(line), rest

    def imported_modules(self) -> list[str]:
        """The modules the zygote process has imported (what its forks start with)."""
        self.wait_ready()
        answer, _ = self._ask({"query": "modules"})
        return list(answer["modules"])

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def close(self, timeout_s: float = 20.0) -> None:
        """Stop the zygote (it kills the launchers still running); its fork server exits once no
        forked launcher holds its liveness pipe any more."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
