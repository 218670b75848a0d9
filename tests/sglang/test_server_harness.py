"""The test harness survives a port taken between its pick and SGLang's bind (CI stop 26:
uvicorn failed to bind, SGLang exited with status 3 at start-up, seven tests errored)."""

from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path

import pytest

from controlplane.service.ports import free_port
from sglang_ext.testing.server import BIND_FAILURE, ServerError, SGLangServer, cpu_env

pytestmark = pytest.mark.sglang


STAND_IN = """
import sys

import uvicorn


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


port = int(sys.argv[sys.argv.index("--port") + 1])
uvicorn.run(app, host="127.0.0.1", port=port, log_level="info")
"""
"""A launcher stand-in: uvicorn -- the server SGLang's HTTP entry point runs (``uvicorn.run`` in
``sglang.srt.entrypoints.http_server``) -- binding the ``--port`` it is given, answering every
path 200. Its bind failure is uvicorn's own log line, the one a real SGLang launcher prints;
a real launcher takes ~35 s to reach its bind here, twice for this test."""


def _stand_in(tmp_path: Path) -> str:
    """An interpreter path that runs :data:`STAND_IN` with the launcher's arguments."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    python.chmod(0o755)
    return str(python)


def test_a_server_whose_port_was_taken_restarts_on_another(tmp_path: Path) -> None:
    """The first start fails on uvicorn's bind (the port squatted), its log is kept beside the
    new one, and the server answers on another port. Control: without a retry left, the same
    start fails and says SGLang exited."""
    port = free_port()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        server = SGLangServer(tmp_path, log_path=tmp_path / "server.log", port=port, bind_retries=1,
                              python=_stand_in(tmp_path), startup_timeout_s=60)
        try:
            server.start()
            assert server.port != port
            failed_log = tmp_path / f"server.port{port}.log"
            assert BIND_FAILURE in failed_log.read_text(), "the first start did not fail on the bind"
            assert server._healthy()
        finally:
            server.stop()
        control = SGLangServer(tmp_path, log_path=tmp_path / "control.log", port=port, bind_retries=0,
                               python=_stand_in(tmp_path), startup_timeout_s=60)
        with pytest.raises(ServerError, match="exited with"):
            control.start()
        assert BIND_FAILURE in (tmp_path / "control.log").read_text()


def test_sglangs_http_entry_point_binds_with_uvicorn() -> None:
    """What makes the stand-in's bind failure SGLang's: the installed HTTP entry point serves
    with ``uvicorn.run`` (read from its source, without importing SGLang)."""
    spec = importlib.util.find_spec("sglang")  # finds the package without importing it
    assert spec is not None and spec.origin is not None
    assert "uvicorn.run(" in (Path(spec.origin).parent / "srt" / "entrypoints" / "http_server.py").read_text()


@pytest.mark.parametrize(("outer", "own", "want"), [(None, None, "1"), ("2", None, "2"), ("2", "3", "3")])
def test_servers_run_torch_on_one_openmp_thread_unless_told(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           outer: str | None, own: str | None, want: str) -> None:
    """The CPU recipe's environment (``CPU_ENV``): a server process gets ``OMP_NUM_THREADS=1``
    unless the caller's environment or the server's own ``env`` sets it (a stand-in interpreter
    records the environment it was started with; no SGLang starts)."""
    if outer is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", outer)
    seen = tmp_path / "env.txt"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho \"$OMP_NUM_THREADS\" > {seen}\n")
    fake.chmod(0o755)
    server = SGLangServer(tmp_path, log_path=tmp_path / "server.log", port=1, python=str(fake),
                          env={} if own is None else {"OMP_NUM_THREADS": own})
    server.spawn()
    assert server._proc is not None and server._proc.wait(timeout=30) == 0
    assert seen.read_text().strip() == want
    assert cpu_env() == {"OMP_NUM_THREADS": outer or "1"}
    assert cpu_env(server.env) == {"OMP_NUM_THREADS": want}  # what a result records for this server
