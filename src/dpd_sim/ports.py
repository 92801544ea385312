"""Ports for the engines, routers and servers that tests, demos and benchmarks start on 127.0.0.1."""

from __future__ import annotations

import random
import socket
from pathlib import Path

HOST = "127.0.0.1"


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out for `bind(port 0)` and outgoing connections."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(count: int, *, taken: set[int] | None = None, rng: random.Random | None = None) -> list[int]:
    """`count` distinct ports free on 127.0.0.1, from outside the kernel's ephemeral range.

    An engine's own sockets (torch's store, ZMQ) bind port 0 while it starts. A port probed free
    with port 0 and closed again comes from that same range, and one of them can take it before the
    engine it was meant for binds it (seen in CI: the NIXL side channel's listener died with "Address
    already in use" and the engine never became healthy). Below the range nothing is handed out by
    the kernel; `taken` are ports not to give again.
    """
    rng = rng or random.Random()
    low, high = ephemeral_range()
    candidates = range(10000, low) if low > 11000 else range(high + 1, 65536)
    chosen: list[int] = []
    avoid = set(taken or ())
    for _ in range(50 * count + 200):
        if len(chosen) == count or len(candidates) == 0:
            break
        port = rng.choice(candidates)
        if port in avoid:
            continue
        avoid.add(port)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((HOST, port))
            except OSError:
                continue
        chosen.append(port)
    while len(chosen) < count:  # no room outside the ephemeral range: the kernel's choice
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((HOST, 0))
            port = int(sock.getsockname()[1])
        if port not in avoid:
            avoid.add(port)
            chosen.append(port)
    return chosen


# How often a server is started on fresh ports when another process bound a chosen one first.
BIND_ATTEMPTS = 4


def port_taken(log: str) -> bool:
    """Whether a server's output says another process bound a port it was given first (uvicorn writes "address
    already in use", the OS's message and other servers "Address already in use")."""
    return "address already in use" in log.lower()


def free_port() -> int:
    """One port from `free_ports`: for a server started next, in this process or another."""
    return free_ports(1)[0]
