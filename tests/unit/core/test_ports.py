"""Ports for brokers that restart on the same port (edgepfl/broker.py)."""

from __future__ import annotations

import socket

from edgepfl.broker import LISTEN_PORTS, free_port


def test_a_restartable_port_is_free_and_outside_the_ephemeral_range():
    """An ephemeral port can be taken by any process's outgoing connection while a broker on
    it is down for a restart; one below the ephemeral range cannot."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    ports = {free_port(restartable=True) for _ in range(20)}
    assert all(p in LISTEN_PORTS and p < ephemeral_low for p in ports)
    assert len(ports) > 1  # drawn, so that parallel test runs rarely pick the same one
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))  # free
