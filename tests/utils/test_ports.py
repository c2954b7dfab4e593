"""Rendezvous and server ports are drawn outside the ephemeral range, where outgoing connections take
their local ports (a port found free there could be taken before the store binds it: EADDRINUSE)."""

import socket

from hybridflow.utils import ports


def test_ports_lie_below_the_ephemeral_range_above_ray_s_worker_ports_and_bind():
    low, _ = ports.ephemeral_port_range()
    drawn = {ports.find_free_port() for _ in range(20)}
    assert all(20_000 <= port < low for port in drawn), (drawn, low)
    assert len(drawn) > 10  # drawn at random, not one port handed to every caller
    for port in list(drawn)[:3]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_in_use_is_skipped(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        choices = iter([busy, busy, busy + 1 if busy < 65535 else busy - 1])
        monkeypatch.setattr(ports, "ephemeral_port_range", lambda: (60000, 60999))
        monkeypatch.setattr(ports._RANDOM, "choice", lambda candidates: next(choices))
        assert ports.find_free_port() != busy


def test_without_a_range_outside_the_ephemeral_one_the_os_chooses(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_port_range", lambda: (1024, 65535))
    port = ports.find_free_port()
    assert 1024 <= port <= 65535
