"""Ports for servers that bind late: never from the kernel's ephemeral range unless asked."""

from __future__ import annotations

import socket

from areal_cli import procs
from areal_cli.launchers import node


def test_a_scan_from_below_jumps_over_the_ephemeral_range():
    eph = procs.ephemeral_ports()
    got = procs.free_ports(3, start=eph.start - 1)
    # eph.start - 1 may be taken on this host; whatever is picked lies outside the range.
    assert len(set(got)) == 3 and not any(p in eph for p in got)
    assert got[-1] >= eph.stop  # at most one port fits below it, the rest come from above


def test_a_scan_that_starts_inside_the_range_stays_there():
    eph = procs.ephemeral_ports()
    start = eph.start + 100
    (port,) = procs.free_ports(1, start=start)
    assert start <= port < eph.stop


def test_a_taken_port_is_skipped():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        assert taken not in procs.free_ports(1, start=taken)


def test_a_node_picks_a_server_port_from_its_port_base_not_the_kernel(monkeypatch):
    monkeypatch.setenv("AREAL_PORT_BASE", "21000")
    ports = {node.free_port("127.0.0.1") for _ in range(20)}
    assert all(21000 <= p < 32768 for p in ports), ports
    assert len(ports) > 1  # runners of one job starting at once seldom try the same port
    monkeypatch.delenv("AREAL_PORT_BASE")
    assert node.free_port("0.0.0.0") not in procs.ephemeral_ports()
