"""Fixtures for the gRPC service tests: real servers on loopback port 0, real clients.

Every server here fronts the real embedded control plane (``controlplane.embedded``); nothing
about gRPC is mocked. Waits poll with a deadline (:func:`wait_until`), never a bare sleep.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from controlplane import api
from controlplane.cli.serve_cmd import build_control_plane
from controlplane.model import Batch, Hardware, ModelSpec, Profile
from controlplane.policy import Policy
from controlplane.service.client import GrpcControlPlane
from controlplane.service.metrics import ServiceMetrics
from controlplane.service.server import ControlPlaneServer, ServerConfig, create_server
from controlplane.service.worker_session import Backoff

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKEN = "s3cret-token"


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0, every_s: float = 0.02) -> bool:
    """Poll ``predicate`` until it is true or ``timeout_s`` passes; return its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return bool(predicate())
        time.sleep(every_s)


def worker_info(worker_id: str = "w0", layers: int = 8, budget_blocks: int = 4000) -> api.WorkerInfo:
    return api.WorkerInfo(
        worker_id=worker_id,
        model=ModelSpec(layers=layers, block_size=16, block_bytes=65536),
        hardware=Hardware(gpu_kv_budget_blocks=budget_blocks, h2d_gbps=25.0),
        profile=Profile(layer_compute_ms=(0.5,) * layers),
    )


def step_report(step: int, requests: dict[str, int], finished: tuple[str, ...] = ()) -> api.StepReport:
    """A report with the given running requests (id -> context tokens)."""
    return api.StepReport(
        step=step,
        now_ms=step * 10.0,
        running=tuple(
            api.RequestState(id=rid, context_tokens=ctx, slo_tbt_ms=200.0)
            for rid, ctx in requests.items()
        ),
        observed_step_ms=4.0 if step else None,
        finished=finished,
    )


def small_batch(n: int = 3, layers: int = 8, budget_blocks: int = 200) -> Batch:
    return Batch.from_dict(
        {
            "model": {"layers": layers, "block_size": 16, "block_bytes": 65536},
            "hardware": {"gpu_kv_budget_blocks": budget_blocks, "h2d_gbps": 25.0},
            "profile": {"layer_compute_ms": 0.5},
            "requests": [
                {"id": f"r{i}", "context_tokens": 200 + 150 * i, "slo_tbt_ms": 200.0}
                for i in range(n)
            ],
            "policy": {"alpha": 1.0, "window_min": 1, "window_max": 16},
        }
    )


class Served:
    """A running in-process server and its control plane."""

    def __init__(self, server: ControlPlaneServer, port: int, control_plane: object) -> None:
        self.server = server
        self.port = port
        self.control_plane = control_plane
        self.target = f"127.0.0.1:{port}"
        self.notifier: object = None
        """The control plane's decision notifier (its ``on_plan`` wakes a worker's stream)."""

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.server.metrics.value(name, labels)


@pytest.fixture
def serve() -> Iterator[Callable[..., Served]]:
    """Factory: ``serve(config=..., policy=...)`` starts a server on 127.0.0.1:0."""
    started: list[Served] = []

    def start(config: ServerConfig | None = None, policy: Policy | None = None) -> Served:
        config = config or ServerConfig(max_sessions=16, max_watchers=4)
        metrics = ServiceMetrics()
        cp, notifier = build_control_plane(policy, config.policy_token, metrics)
        server, port = create_server("127.0.0.1:0", cp, config, metrics, notifier)
        server.start()
        served = Served(server, port, cp)
        served.notifier = notifier
        started.append(served)
        return served

    yield start
    for s in started:
        s.server.stop(0.5)
        close = getattr(s.control_plane, "close", None)
        if callable(close):
            close()


@pytest.fixture
def served(serve: Callable[..., Served]) -> Served:
    """A server with a policy token configured."""
    return serve(ServerConfig(max_sessions=16, max_watchers=4, policy_token=TOKEN))


@pytest.fixture
def connect() -> Iterator[Callable[..., GrpcControlPlane]]:
    """Factory for clients (closed at teardown)."""
    clients: list[GrpcControlPlane] = []

    def make(target: str, **kwargs: object) -> GrpcControlPlane:
        kwargs.setdefault("backoff", Backoff(initial_s=0.05, max_s=0.5))
        kwargs.setdefault("timeout_s", 5.0)
        client = GrpcControlPlane(target, **kwargs)  # type: ignore[arg-type]
        clients.append(client)
        return client

    yield make
    for c in clients:
        c.close()


@pytest.fixture
def client(served: Served, connect: Callable[..., GrpcControlPlane]) -> GrpcControlPlane:
    return connect(served.target)


@pytest.fixture
def channel(served: Served) -> Iterator[grpc.Channel]:
    ch = grpc.insecure_channel(served.target)
    yield ch
    ch.close()


def kvplane_cmd(*args: str) -> list[str]:
    """Command line running the real `kvplane` CLI with this interpreter."""
    return [sys.executable, "-m", "kvplane.cli", *args]


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


class ServeProcess:
    """`kvplane serve` as a real subprocess on a fixed port (so it can be restarted on it)."""

    def __init__(self, port: int, metrics_port: int, log_path: Path, *extra: str) -> None:
        self.port = port
        self.log_path = log_path
        self.metrics_port = metrics_port
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.target = f"127.0.0.1:{port}"

    @classmethod
    def with_policy(cls, root: Path, policy: dict[str, object]) -> ServeProcess:
        """Started on free ports with ``policy`` written to ``root/policy.json``, logging to
        ``root/serve.log``."""
        from controlplane.service.ports import free_ports

        path = root / "policy.json"
        path.write_text(json.dumps(policy))
        service = cls(*free_ports(2), root / "serve.log", "--policy", str(path))
        service.start(timeout_s=60.0)
        return service

    def start(self, timeout_s: float = 120.0) -> None:
        self.kill()  # a start over a live process would orphan it (kill() only knows the newest)
        cmd = kvplane_cmd(
            "serve",
            "--listen", self.target,
            "--metrics-port", str(self.metrics_port),
            "--grace-s", "0.5",
            *self.extra,
        )
        with open(self.log_path, "ab") as log:  # a file, not a pipe: a full pipe blocks the server
            self.proc = subprocess.Popen(cmd, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT)
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        def healthy() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                out = self.output()
                raise RuntimeError(f"kvplane serve exited with {self.proc.returncode}: {out}")
            with grpc.insecure_channel(self.target) as ch:
                try:
                    got = health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(), timeout=0.5
                    )
                except grpc.RpcError:
                    return False
                return bool(got.status == health_pb2.HealthCheckResponse.SERVING)

        if not wait_until(healthy, timeout_s, every_s=0.1):
            self.kill()
            raise RuntimeError(f"kvplane serve on {self.target} not healthy within {timeout_s}s")

    def metric(self, name: str) -> float:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def metric_sum(self, name: str) -> float:
        """Sum of a metric over all its label sets (0 when absent)."""
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name + " ") or line.startswith(name + "{")
        )

    def rss_bytes(self) -> int:
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def terminate(self, timeout_s: float = 15.0) -> int:
        assert self.proc is not None
        self.proc.terminate()
        return self.proc.wait(timeout=timeout_s)

    def output(self) -> str:
        """Everything the server logged so far (JSON lines)."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
