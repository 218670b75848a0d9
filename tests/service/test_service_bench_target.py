"""`kvplane bench service --target`: a target that is not HOST:PORT, or one where no service
answers, ends in one line (exit 2 / 1), not a traceback."""

from __future__ import annotations

import subprocess

from controlplane.service.ports import free_ports

from .conftest import kvplane_cmd, subprocess_env


def _bench(target: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        kvplane_cmd("bench", "service", "--target", target, "--workers", "1", "--rates", "0",
                    "--duration-s", "1", "--no-save", "--connect-timeout-s", "2", *extra),
        env=subprocess_env(), capture_output=True, text=True, timeout=120,
    )


def test_a_malformed_target_exits_2_naming_it() -> None:
    proc = _bench("nonsense")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "kvplane bench service: target: 'nonsense' is not grpc://HOST:PORT with PORT in [1, 65535]"
    )


def test_a_target_where_nothing_listens_exits_1_in_one_line() -> None:
    port = free_ports(1)[0]
    proc = _bench(f"127.0.0.1:{port}")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    ours = [ln for ln in proc.stderr.splitlines() if ln.startswith("kvplane bench service: ")]
    assert len(ours) == 1 and f"--target 127.0.0.1:{port}:" in ours[0] and "did not connect" in ours[0]


def test_a_connect_timeout_out_of_range_exits_2_naming_it() -> None:
    proc = _bench("127.0.0.1:1", "--connect-timeout-s", "0")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "kvplane bench service: --connect-timeout-s 0 is out of range (0, 3600]"
    )
