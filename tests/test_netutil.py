"""free_port: a port outside the ranges other processes are handed ports from."""

from __future__ import annotations

import socket

from serve_app.netutil import _quiet_ports, free_port


def test_free_ports_avoid_ray_worker_and_ephemeral_ports_and_can_be_bound() -> None:
    quiet = _quiet_ports()
    ports = {free_port() for _ in range(20)}
    if quiet:  # Linux's default ephemeral range starts at 32768
        assert all(20000 <= p < 32768 and p in quiet for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
