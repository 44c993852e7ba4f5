"""Process plumbing: spawn in a session of its own, find every descendant, tear trees down.

Why a marker in the environment: torchrun starts each worker in a session of its own and a
SIGKILLed torchrun leaves them reparented to init, so neither the process group nor the tree
alone finds everything. Every process a job starts inherits `AREAL_JOB_MARKER=<marker>`, and
teardown collects the live tree *and* every process that carries the marker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import psutil

MARKER_ENV = "AREAL_JOB_MARKER"


def spawn(
    argv: Sequence[str],
    *,
    env: dict[str, str],
    cwd: str | Path | None = None,
    stdout=subprocess.PIPE,
) -> subprocess.Popen:
    """Start argv in a new session (its own process group), stdout+stderr merged."""
    return subprocess.Popen(
        list(argv),
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        bufsize=0,
    )


def tree(pids: Iterable[int]) -> list[psutil.Process]:
    """The processes and all their live descendants."""
    found: dict[int, psutil.Process] = {}
    for pid in pids:
        try:
            p = psutil.Process(pid)
            found[p.pid] = p
            for c in p.children(recursive=True):
                found[c.pid] = c
        except psutil.Error:
            continue
    return list(found.values())


def find_marked(marker: str) -> list[psutil.Process]:
    """Every live process whose environment carries this job's marker."""
    me = os.getpid()
    hits = []
    for p in psutil.process_iter(["pid"]):
        if p.pid == me:
            continue
        try:
            if p.environ().get(MARKER_ENV) == marker:
                hits.append(p)
        except (psutil.Error, OSError):
            continue
    return hits


def terminate(procs: Sequence[psutil.Process], grace: float = 5.0) -> list[psutil.Process]:
    """SIGTERM to each process and its group, wait up to `grace`, SIGKILL the rest.

    Returns the processes that were still alive after SIGKILL (normally none).
    """
    procs = [p for p in procs if _alive(p)]
    if not procs:
        return []
    for p in procs:
        _signal(p, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        _signal(p, signal.SIGKILL)
    _, still = psutil.wait_procs(alive, timeout=2.0)
    return still


def kill_job(marker: str | None, roots: Iterable[int] = (), grace: float = 5.0) -> int:
    """Tear down a job: the trees under `roots` plus every process carrying `marker`.

    Collects twice, because a dying parent can spawn or orphan children while we work.
    Returns how many processes were signalled.
    """
    count = 0
    roots = list(roots)
    for _ in range(2):
        procs = {p.pid: p for p in tree(roots)}
        if marker:
            for p in find_marked(marker):
                procs[p.pid] = p
                for c in _children(p):
                    procs[c.pid] = c
        procs.pop(os.getpid(), None)
        if not procs:
            break
        count += len(procs)
        terminate(list(procs.values()), grace=grace)
    return count


def pid_alive(pid: int, create_time: float | None = None) -> bool:
    """True when pid runs and, if given, is the same process (not a reused pid). A process this
    user may not look at (hidepid, another uid) is not a dead one: only "no such process" is."""
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            if p.status() == psutil.STATUS_ZOMBIE:
                return False
            return create_time is None or abs(p.create_time() - create_time) < 1.0
    except psutil.ZombieProcess:
        return False
    except psutil.AccessDenied:
        return psutil.pid_exists(pid)
    except psutil.NoSuchProcess:
        # hidepid=2 hides /proc/PID altogether from those who may not look; kill(pid, 0) still
        # tells whether it exists.
        try:
            os.kill(pid, 0)
        except PermissionError:
            return True
        except OSError:
            return False
        return True
    except psutil.Error:
        return False


def create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def port_holder(port: int) -> str | None:
    """Describe the process listening on `port` ("pid 123: python -m x"), if any."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.Error:
        conns = []
    for c in conns:
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN:
            if c.pid:
                try:
                    cmd = " ".join(psutil.Process(c.pid).cmdline())[:120]
                except psutil.Error:
                    cmd = "?"
                return f"pid {c.pid}: {cmd}"
            return "another process (pid not visible)"
    return None


def bind_address(host: str) -> tuple[int, tuple]:
    """(family, sockaddr) for binding `host`; a host that does not resolve is a usage error."""
    import socket

    from areal_cli.errors import UsageError

    try:
        infos = socket.getaddrinfo(
            host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as e:
        raise UsageError(f"--host {host!r} does not resolve: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    return family, addr


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    import socket

    family, addr = bind_address(host)
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr[0], port, *addr[2:]))
        except OSError:
            return False
    return True


DEFAULT_PORT_BASE = 30000  # below Linux's default ephemeral range (32768-60999)


def ephemeral_ports() -> range:
    """The ports the kernel hands to outgoing connections (net.ipv4.ip_local_port_range)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return range(int(low), int(high) + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


def free_ports(
    count: int,
    host: str = "127.0.0.1",
    start: int = DEFAULT_PORT_BASE,
    avoid: set[int] | None = None,
) -> list[int]:
    """`count` ports that are free now (and not in `avoid`), scanning upward from `start`.

    A scan that starts below the kernel's ephemeral range jumps over it: a server binds its
    port only after loading its model, and meanwhile any outgoing connection on the host may
    be given a free port of that range (an SGLang start died on this). A scan that starts
    inside it was asked for there and stays."""
    from areal_cli.errors import UsageError

    bind_address(host)  # fail fast on a bad host, not after scanning every port
    ephemeral = ephemeral_ports()
    skip = ephemeral if start < ephemeral.start else range(0)
    ports: list[int] = []
    port = start
    while len(ports) < count:
        if port in skip:
            port = skip.stop
        if port > 65535:
            raise UsageError(f"no {count} free ports on {host} from {start} up")
        if port not in (avoid or ()) and port_free(port, host):
            ports.append(port)
        port += 1
    return ports


def wait_until(predicate, timeout: float, cap: float = 0.1) -> bool:
    """Poll with backoff capped at `cap` seconds; no fixed sleeps."""
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        if predicate():
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(delay, cap, left))
        delay *= 2


def _children(p: psutil.Process) -> list[psutil.Process]:
    try:
        return p.children(recursive=True)
    except psutil.Error:
        return []


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal(p: psutil.Process, sig: int) -> None:
    try:
        pgid = os.getpgid(p.pid)
        # Signal the whole group when p leads it, so servers' own helpers hear it too.
        if pgid == p.pid:
            os.killpg(pgid, sig)
        else:
            p.send_signal(sig)
    except (ProcessLookupError, psutil.Error, PermissionError, OSError):
        pass
