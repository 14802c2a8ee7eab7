"""Small network helpers shared by the launcher, the tests and the benchmarks (torch-free)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (the OS picks it; bind to port 0).

    Why "a moment ago": the socket is closed before the caller uses the port, so another process can take
    it in between. That race is accepted for rendezvous ports of local jobs (a clash fails fast at
    rendezvous, it does not hang); never use this for anything security-relevant.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
