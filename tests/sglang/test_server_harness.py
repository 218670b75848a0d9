"""The test harness survives a port taken between its pick and SGLang's bind (CI stop 26:
uvicorn failed to bind, SGLang exited with status 3 at start-up, seven tests errored)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from controlplane.service.ports import free_port
from sglang_ext.testing.server import BIND_FAILURE, SGLangServer, cpu_env

from .conftest import greedy

pytestmark = pytest.mark.sglang


def test_a_server_whose_port_was_taken_restarts_on_another(tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        server = SGLangServer(tiny_model_dir, log_path=tmp_path / "server.log", port=port, bind_retries=1)
        try:
            server.start()
            assert server.port != port
            failed_log = tmp_path / f"server.port{port}.log"
            assert BIND_FAILURE in failed_log.read_text(), "the first start did not fail on the bind"
            assert greedy(server, "The quick brown fox", 2)["text"]
        finally:
            server.stop()


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
