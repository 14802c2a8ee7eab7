"""The launcher's port choice (launch/net.py): free_port returns a port that can be bound and lies outside the
kernel's ephemeral range, so no outgoing connection can take it before the rendezvous binds it."""

from __future__ import annotations

import pytest

from launch.net import free_port

pytestmark = pytest.mark.timeout(120)  # the slowest starts a worker (imports torch) or `python -m launch`


def test_free_port_is_bindable_and_outside_the_ephemeral_range():
    # An ephemeral port can be handed to any outgoing connection (gloo's) before the rendezvous binds it.
    import socket

    from launch.net import ephemeral_range

    low, high = ephemeral_range()
    for _ in range(20):
        port = free_port()
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
        assert 0 < port < 65536 and not low <= port <= high, (port, low, high)
