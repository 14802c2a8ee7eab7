"""Small network helpers shared by the launcher, the tests and the benchmarks (torch-free)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_FALLBACK_EPHEMERAL = (32768, 60999)  # Linux's default range, used where /proc does not say
_LOWEST = 10000  # well-known and registered service ports crowd the range below this


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it hands out on its own (connect, bind to 0), inclusive."""
    try:
        low, high = (int(v) for v in _EPHEMERAL_RANGE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return _FALLBACK_EPHEMERAL


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago, outside the kernel's ephemeral range.

    Why outside it: the port is only used after the caller starts a process (seconds later), and in that
    window any outgoing connection on the machine (gloo opens one per pair of ranks) may be given an
    ephemeral port by the kernel; a rendezvous port chosen by binding to port 0 came from that same range
    and was taken that way in CI (EADDRINUSE at rendezvous). Outside the range only another explicit bind
    can take it, and those are rare and random here. Never use this for anything security-relevant.
    """
    low, high = ephemeral_range()
    # The larger gap outside [low, high] that is at least 1000 ports wide; if none is, the kernel's pick.
    gaps = [(a, b) for a, b in ((_LOWEST, low - 1), (high + 1, 65535)) if b - a >= 1000]
    if gaps:
        a, b = max(gaps, key=lambda g: g[1] - g[0])
        for _ in range(64):
            port = random.randint(a, b)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
