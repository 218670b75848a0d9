"""The test harness survives a port taken between its pick and SGLang's bind (CI stop 26:
uvicorn failed to bind, SGLang exited with status 3 at start-up, seven tests errored)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from controlplane.service.ports import free_port
from sglang_ext.testing.server import BIND_FAILURE, SGLangServer

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
