"""Free TCP ports for rendezvous stores and local servers, chosen where nothing else lands.

A port found free is handed on (to ``MASTER_PORT``, a server's ``--port``) and bound later by
another process. Asking the OS for port 0 returns one from the *ephemeral* range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 on Linux), the same range every outgoing
connection takes its local port from; on a busy machine (Ray opens many) one of them can take the
port in the gap, and torch's TCPStore then fails with ``EADDRINUSE``. :func:`find_free_port`
therefore draws ports at random *below* the ephemeral range and above Ray's worker ports
(10002-19999 by default), checks that each binds, and falls back to the OS's choice only where no
such range exists. Two callers drawing the same port at once is then the only race left (about one
in 12,000 per pair, each re-checked by binding).
"""

from __future__ import annotations

import random
import socket

_RAY_WORKER_PORTS_END = 20_000  # Ray's default max_worker_port is 19999
_MIN_RANGE = 1_000  # a range narrower than this is not worth drawing from
_RANDOM = random.SystemRandom()  # every process draws its own sequence (no shared seed)


def ephemeral_port_range() -> tuple[int, int]:
    """The OS's range for outgoing connections' local ports (Linux's default where unreadable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def find_free_port(host: str = "127.0.0.1", attempts: int = 64) -> int:
    """A TCP port free on ``host`` now, outside the ephemeral range where one exists (see the module
    docstring); the OS's choice otherwise."""
    low, high = ephemeral_port_range()
    if low - _RAY_WORKER_PORTS_END >= _MIN_RANGE:
        candidates = range(_RAY_WORKER_PORTS_END, low)
    elif 65535 - high >= _MIN_RANGE:
        candidates = range(high + 1, 65536)
    else:
        candidates = None
    if candidates is not None:
        for _ in range(attempts):
            port = _RANDOM.choice(candidates)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
