"""Small network helpers shared by the replica (TP rendezvous), tests and benchmarks."""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Ports above Ray's worker ports (10002-19999 by default) and below the OS's ephemeral range
# (Linux: 32768-60999 by default), from which every process that binds port 0 or connects out
# is handed one. A port the OS picked from that range was taken, once, by one of the processes
# a Ray start launches between free_port() and the Serve proxy's bind (a fresh-clone CI run:
# "Failed to bind to address").
_LOW = 20000
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _quiet_ports() -> range:
    try:
        first = int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first = 32768  # Linux's default; macOS's range starts at 49152
    return range(_LOW, min(first, 32768))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, chosen where nothing else is handed ports."""
    quiet, pick = _quiet_ports(), random.SystemRandom()
    for _ in range(64 if quiet else 0):
        port = pick.choice(quiet)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no quiet range here, or it is busy: the OS's choice
        s.bind((host, 0))
        return s.getsockname()[1]
