"""Loopback ports picked below the kernel's ephemeral range (controlplane/service/ports.py)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from controlplane.service.ports import PORT_RANGE, bindable, ephemeral_low, free_port, free_ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    ports = free_ports(6)
    assert len(set(ports)) == 6
    low, high = PORT_RANGE
    assert all(low <= p <= min(high, ephemeral_low() - 1) for p in ports), ports
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
    assert PORT_RANGE[0] <= free_port() < ephemeral_low()


def test_a_taken_port_is_never_returned() -> None:
    """Eight candidates, six taken: only the two free ones can come back (control: with nothing
    held, the ones held here do come back, so the check can fail).

    Another process may hold some of the eight (the suite's early-started servers pick their
    ports from the same range: CI, session 49, saw 12007 taken): those count among the six
    taken, and this test holds the rest."""
    low = PORT_RANGE[0]
    candidates = list(range(low, low + 8))
    elsewhere = [port for port in candidates if not bindable(port)]
    if len(elsewhere) > 5:  # one at least held here, for the control
        pytest.skip(f"ports {elsewhere} are in use on this host")
    ours = [port for port in candidates if port not in elsewhere][: 6 - len(elsewhere)]
    free = [port for port in candidates if port not in elsewhere and port not in ours]
    held: list[socket.socket] = []
    try:
        for port in ours:
            sock = socket.socket()
            held.append(sock)
            sock.bind(("127.0.0.1", port))
        picked = free_ports(2, rng=random.Random(0), eph_low=low + 8)
        assert sorted(picked) == free
    finally:
        for sock in held:
            sock.close()
    seen = {p for seed in range(20) for p in free_ports(2, rng=random.Random(seed), eph_low=low + 8)}
    assert seen & set(ours)


def test_avoided_ports_are_never_returned() -> None:
    """Ports handed to servers that have not bound them yet are skipped (control: without
    ``avoid`` the same picks do include them)."""
    low = PORT_RANGE[0]
    picks = [free_ports(2, rng=random.Random(seed), eph_low=low + 8) for seed in range(20)]
    avoid = {p for pick in picks for p in pick} - {low + 7}
    assert len(avoid) >= 2
    for seed in range(20):
        assert not set(free_ports(1, rng=random.Random(seed), eph_low=low + 8, avoid=avoid)) & avoid
    assert free_port(avoid=set(range(low, low + 7))) not in range(low, low + 7)


def test_a_host_without_room_below_the_ephemeral_range_gets_kernel_ports() -> None:
    ports = free_ports(3, eph_low=PORT_RANGE[0] + 2)
    assert len(set(ports)) == 3 and all(p >= ephemeral_low() for p in ports)
    assert free_ports(0) == []
    with pytest.raises(ValueError, match="count"):
        free_ports(-1)


def test_the_ephemeral_range_is_read_from_the_kernel_file(tmp_path: Path) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t60999\n")
    assert ephemeral_low(f) == 40000
    f.write_text("garbage")
    assert ephemeral_low(f) == 32768
    assert ephemeral_low(tmp_path / "missing") == 32768
