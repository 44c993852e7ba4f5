"""Which node a runner is on and the address other nodes reach it by, and a meeting point for
the runners of one multi-node process (torchrun's rendezvous, a multi-node server's
--dist-init-addr): the first node picks a port on its own address and writes it to a file
on the shared filesystem, the others read it there.

A scheduler that knows the node tells its runners in AREAL_NODE_NAME, AREAL_NODE_ADDR and
AREAL_NODE_INDEX (Ray: the node's IP; Slurm: SLURMD_NODENAME and its NodeAddr, set by
schedulers/slurm/step.py; several nodes of either may share one host and its hostname);
elsewhere the hostname and its address.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from areal_cli import procs, settings

NODE_ADDR = "{node_addr}"  # in a plan's host and argv: this node's address, found on the node


def name() -> str:
    return os.environ.get("AREAL_NODE_NAME") or socket.gethostname()


def index() -> int:
    """This node's place among the nodes of its job step (0 is the first)."""
    try:
        return int(os.environ.get("AREAL_NODE_INDEX") or "0")
    except ValueError:
        return 0


def address() -> str:
    """The IPv4 address other nodes reach this one by: the one its scheduler names, else the
    hostname's address when that is not loopback, else the first non-loopback address."""
    if os.environ.get("AREAL_NODE_ADDR"):
        return os.environ["AREAL_NODE_ADDR"]
    here = _ipv4(socket.gethostname())
    if here and not here.startswith("127."):
        return here
    import ipaddress

    import psutil

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    return here or "127.0.0.1"


def _ipv4(host: str) -> str | None:
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError):
        return None


def free_port(host: str) -> int:
    """A port free on this node now, for a process that binds it later (a server after
    loading its model). Not one the kernel picks (bind to port 0): those come from the
    ephemeral range, where an outgoing connection may take it first. Scanned from the port
    base (AREAL_PORT_BASE), from a random point in its first thousand, so that the runners
    of one job starting at once on a node seldom try the same port."""
    import random

    start = settings.port_base(procs.DEFAULT_PORT_BASE) + random.randrange(1000)
    return procs.free_ports(1, host if host not in ("", "0.0.0.0") else "", start=start)[0]


def meet(path: str | Path, timeout: float = 600.0, alive=lambda: True) -> str:
    """host:port where the nodes of one multi-node process meet. The first node (index 0)
    picks a free port on its address and writes the file; the others wait for it (as long as
    `alive()` holds, at most `timeout` seconds)."""
    path = Path(path)
    if index() == 0:
        host = address()
        endpoint = f"{host}:{free_port(host)}"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(endpoint)
        os.replace(tmp, path)
        return endpoint
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        try:
            text = path.read_text().strip()
        except OSError:
            text = ""
        if text:
            return text
        time.sleep(0.05)
    raise TimeoutError(f"the first node did not write {path} within {timeout:g}s")
