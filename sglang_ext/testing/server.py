"""Launch a real SGLang server on a free port, wait for health, tear it down.

:class:`SGLangServer` runs ``python -m sglang.launch_server`` in its own process
group with the CPU settings SGLang needs here (torch_native attention, no CUDA
graphs, no warm-up), logs to a file, polls ``/health`` with a deadline and kills
the whole group on :meth:`stop`. Failures quote the log tail.

Usage (pytest fixture sketch)::

    with SGLangServer(model_dir, log_path=tmp / "server.log") as server:
        server.post("/v1/completions", {...})
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controlplane.service.ports import free_port
from sglang_ext import compat
from sglang_ext.testing.launch_zygote import LaunchZygote
from sglang_ext.testing.zygote_process import ZygoteProcess

CPU_ARGS: tuple[str, ...] = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--disable-cuda-graph",
    "--skip-server-warmup",
    "--max-total-tokens",
    "4096",
    "--mem-fraction-static",
    "0.05",
    "--random-seed",
    "0",
    "--sleep-on-idle",
)
"""Flags that make SGLang 0.5.23 serve the tiny model on a CPU-only host. ``--sleep-on-idle``: an
idle scheduler blocks in ``zmq.Poller.poll`` (woken by the next request, at most 1 s) instead of
spinning -- measured: a test session's idle module servers each burned ~50% of a core on this
2-core host, slowing every other test."""

CPU_ENV: tuple[tuple[str, str], ...] = (("OMP_NUM_THREADS", "1"),)
"""Environment of the CPU recipe, unless the caller's environment sets these. One OpenMP thread:
with torch's default (one per core) the scheduler process keeps a second OpenMP worker spinning
between forwards -- measured on this 2-core host, vanilla SGLang's and the layered scheduler's
main thread and that worker each burned ~100% of a core while serving, so SGLang's tokenizer,
detokenizer and the client were preempting the scheduler (the tiny model gains nothing from a
second thread). The test suite sets the same default for its own reasons (``tests/conftest.py``)."""


def cpu_env(own: Mapping[str, str] | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """:data:`CPU_ENV` as a server started now gets it: the server's ``own`` environment
    (:attr:`SGLangServer.env`) wins, then the caller's (``base``, default ``os.environ``), then
    the recipe's default."""
    own, base = own or {}, os.environ if base is None else base
    return {key: own.get(key, base.get(key, value)) for key, value in CPU_ENV}


BIND_FAILURE = "error while attempting to bind on address"
"""uvicorn's log line when the port is taken (it then exits with status 3)."""

STOP_GRACE_S = 1.0
"""Seconds :meth:`SGLangServer.stop` gives the process group after SIGTERM before SIGKILL."""


class ServerError(RuntimeError):
    """The server failed to start or died; the message carries the log tail."""


@dataclass
class SGLangServer:
    """One SGLang server process (group) serving ``model_dir`` on ``127.0.0.1:port``."""

    model_dir: Path
    """Model directory (e.g. from :func:`sglang_ext.testing.tiny_model.build_tiny_model`)."""
    log_path: Path
    """File receiving the server's stdout and stderr."""
    extra_args: Sequence[str] = ()
    """Flags appended after :data:`CPU_ARGS` (e.g. ``--enable-layered-kv``)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Environment additions for the server process."""
    base_env: Mapping[str, str] | None = None
    """The environment ``env`` adds to (None: ``os.environ`` when it spawns)."""
    startup_timeout_s: float = 240.0
    """Deadline for ``/health`` to answer 200."""
    port: int = 0
    """Port to bind; 0 picks a free one at start."""
    python: str = sys.executable
    """Interpreter that runs ``sglang.launch_server``."""
    bind_retries: int = 1
    """Start-ups that failed only because the port was taken, retried on a new port (each retry
    gets a fresh ``startup_timeout_s``)."""
    avoid_ports: tuple[int, ...] = ()
    """Ports a retry must not take: those of servers started beside this one, not bound yet."""
    zygote: LaunchZygote | None = None
    """Fork the launcher from this zygote (SGLang imported once for the test session) unless
    :meth:`LaunchZygote.why_not` refuses the launch; None: a fresh process."""
    launched_by: str = ""
    """How the last :meth:`spawn` started the launcher: ``"zygote"``, or ``"fresh process"``
    followed by why the zygote did not."""
    _proc: subprocess.Popen | ZygoteProcess | None = None
    _deadline: float = 0.0

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The launch command line (without :data:`CPU_ARGS`' ``--disable-cuda-graph`` when the
        flags ask for decode graphs, ``--kv-cuda-graphs on``: on a CPU they are captured only under
        the test injector's ``KVPLANE_TEST_TAPE_GRAPHS``)."""
        args = list(self.extra_args)
        graphs = any(a == "--kv-cuda-graphs" and b == "on" for a, b in zip(args, args[1:], strict=False))
        return [
            self.python,
            "-m",
            compat.LAUNCH_SERVER.path,
            "--model-path",
            str(self.model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *(a for a in CPU_ARGS if not (graphs and a == "--disable-cuda-graph")),
            *args,
        ]

    def start(self) -> SGLangServer:
        """Launch and block until healthy; raise :class:`ServerError` with the log tail otherwise."""
        self.spawn()
        return self.wait_ready()

    def spawn(self) -> SGLangServer:
        """Launch without waiting (:meth:`wait_ready` waits): servers spawned together start
        side by side, their imports on both cores of a small host."""
        if self._proc is not None:
            raise ServerError("server already started")
        if not self.port:
            self.port = free_port()
        base = os.environ if self.base_env is None else self.base_env
        env = {**base, **self.env, **cpu_env(self.env, base)}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = self.command()
        reason = "no zygote" if self.zygote is None else self.zygote.why_not(env, self.python)
        if self.zygote is not None and reason is None:
            self._proc = self.zygote.launch(command[3:], env, self.log_path, os.getcwd())
            self.launched_by = "zygote"
        else:
            self.launched_by = f"fresh process ({reason})"
            log_file = self.log_path.open("wb")
            if self.zygote is not None:  # say why the zygote did not fork it (the log's first line)
                log_file.write(f"kvplane test harness: {self.launched_by}\n".encode())
                log_file.flush()
            self._proc = subprocess.Popen(
                command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            log_file.close()
        self._deadline = time.monotonic() + self.startup_timeout_s
        return self

    def wait_ready(self) -> SGLangServer:
        """Block until the spawned server is healthy; stop it and raise :class:`ServerError` with
        the log tail if it exits or is not healthy within ``startup_timeout_s`` of its spawn."""
        if self._proc is None:
            raise ServerError("server not spawned")
        while time.monotonic() < self._deadline:
            if self._proc.poll() is not None:
                if self._port_taken() and self.bind_retries > 0:
                    self._respawn_on_new_port()
                    continue
                raise ServerError(
                    f"SGLang exited with {self._proc.returncode} during start-up\n{self.log_tail()}"
                )
            if self._healthy():
                return self
            try:  # wait on the process itself: returns at once if it dies
                self._proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
        self.stop()
        raise ServerError(f"SGLang not healthy within {self.startup_timeout_s}s\n{self.log_tail()}")

    def _port_taken(self) -> bool:
        """Whether the exit was uvicorn failing to bind the port (someone took it meanwhile)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return False
        return any(BIND_FAILURE in line and f", {self.port})" in line for line in lines)

    def _respawn_on_new_port(self) -> None:
        self.bind_retries -= 1
        self.stop()  # the exited launcher's process group: nothing of it may outlive it
        self.log_path.replace(self.log_path.with_suffix(f".port{self.port}.log"))
        self.port = free_port(avoid=(self.port, *self.avoid_ports))
        self.spawn()

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def log_tail(self, lines: int = 60) -> str:
        """Last ``lines`` lines of the server log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = STOP_GRACE_S, timeout_s: float = 20.0) -> None:
        """SIGTERM the process group, then SIGKILL whatever survives ``grace_s``.

        The scheduler and detokenizer die of the SIGTERM at once (no handler); SGLang's main
        process then takes its child's death for a crash and sleeps 5 s "to let GPU activity
        settle" before it exits (a graceful drain of the main process alone took 17 s here), so
        a short grace and a SIGKILL save ~5 s per server and lose nothing: no kvplane file is
        written by the main process on exit."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=timeout_s)

    def post(self, path: str, payload: Mapping[str, Any], timeout_s: float = 120.0) -> dict:
        """POST JSON, return the decoded JSON body (raises on HTTP errors, with the body)."""
        req = urllib.request.Request(
            self.base_url + path,
            data=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raise ServerError(f"POST {path} -> {exc.code}: {exc.read().decode(errors='replace')}") from exc

    def flush_cache(self, timeout_s: float = 60.0) -> None:
        """POST ``/flush_cache`` until SGLang accepts it.

        SGLang refuses (HTTP 400) while its scheduler is not fully idle, and it still holds
        the last batch for one loop iteration after the final response went out, so a flush
        right after a request can race; retry until ``timeout_s`` and then raise with the body.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            req = urllib.request.Request(self.base_url + "/flush_cache", method="POST")
            try:
                with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                    if resp.status == 200:
                        return
                    body = resp.read().decode(errors="replace")
            except urllib.error.HTTPError as exc:
                body = f"{exc.code}: {exc.read().decode(errors='replace')}"
            if time.monotonic() > deadline:
                raise ServerError(f"POST /flush_cache kept failing for {timeout_s:.0f} s: {body}")
            time.sleep(0.2)

    def stream(self, path: str, payload: Mapping[str, Any], timeout_s: float = 120.0) -> list[dict]:
        """POST a streaming request; return the decoded ``data:`` events (without ``[DONE]``)."""
        req = urllib.request.Request(
            self.base_url + path,
            data=json.dumps({**payload, "stream": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        events = []
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                events.append(json.loads(data))
        return events

    def __enter__(self) -> SGLangServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
