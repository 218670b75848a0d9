"""Loopback ports for servers that a child process binds later (tests, benchmarks, the demo).

``bind(("127.0.0.1", 0))`` hands out a port from the kernel's ephemeral range, the same range
every outgoing connection takes its source port from. Between picking such a port and the child
binding it (an SGLang server binds ~30 s later, after loading its model) any client connection
on the host may take it as its source port, and a health poll to a port nobody listens on yet
can even connect to itself (TCP simultaneous open): uvicorn's bind then fails and SGLang exits
with status 3 at start-up (seen once in CI, stop 26). A port *below* the ephemeral range is
never handed out implicitly, so only an explicit bind can take it.

SGLang 0.5.23 picks its own NCCL/TCPStore port at random in [22000, 29999] below the ephemeral
range (``get_free_port_below_ephemeral``), so these come from below that.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Collection
from pathlib import Path

PORT_RANGE = (12000, 21999)
"""Inclusive range the ports come from: below SGLang's own pick range and the usual ephemeral one."""

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_low(path: Path = EPHEMERAL_RANGE_FILE) -> int:
    """The lowest port the kernel hands out implicitly (32768 where the file cannot be read)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count: int, *, rng: random.Random | None = None, eph_low: int | None = None,
               avoid: Collection[int] = ()) -> list[int]:
    """``count`` distinct ports, each bindable on all interfaces a moment ago, below the ephemeral
    range, none of ``avoid`` (ports handed to servers that have not bound them yet). Falls back to
    kernel-picked ports when the range below it is too small or full (a host whose ephemeral range
    starts low): correct, merely exposed to the race above."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    rng = rng or random.Random()
    low, high = PORT_RANGE
    high = min(high, (ephemeral_low() if eph_low is None else eph_low) - 1)
    picked: list[int] = []
    if high - low + 1 >= 4 * max(count, 1):
        for port in rng.sample(range(low, high + 1), min(high - low + 1, 64 * max(count, 1))):
            if len(picked) == count:
                break
            if port not in avoid and bindable(port):
                picked.append(port)
    while len(picked) < count:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in picked and port not in avoid:
            picked.append(port)
    return picked


def free_port(avoid: Collection[int] = ()) -> int:
    """One port from :func:`free_ports`."""
    return free_ports(1, avoid=avoid)[0]


def bindable(port: int) -> bool:
    """Whether ``port`` can be bound on all interfaces now (what :func:`free_ports` asks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def ipv6_loopback() -> bool:
    """Whether this host can bind IPv6's loopback (``::1``): the IPv6 tests need it."""
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("::1", 0))
        except OSError:
            return False
    return True
