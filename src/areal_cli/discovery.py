"""Finding inference servers for a training job: the registry (waiting for them) or a list.

Only servers we may trust get the job's API key: those whose registry metadata says the job
that holds the key started them. Probing honours the caller's deadline: many probes run at
once, each bounded by the time that is left.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from areal_cli import apikeys
from areal_cli.errors import UsageError, WaitTimeout
from areal_cli.health import probe_health
from areal_cli.registry import Registry, ServerEntry

MAX_PROBES = 64  # health probes in flight at once


@dataclass(frozen=True)
class Found:
    addrs: list[str]
    backend: str
    api_key: str | None
    entries: list[ServerEntry]
    # Registered servers left out, and why (a key we do not hold, another job's key).
    skipped: list[tuple[str, str]] = field(default_factory=list)


def healthy(
    addrs: list[str],
    api_key: str | None = None,
    timeout: float = 2.0,
    deadline: float | None = None,
) -> dict[str, bool]:
    """addr → answers /health within `timeout` (MAX_PROBES at once). With a `deadline`
    (time.monotonic()), no probe runs past it: those it leaves out count as not healthy."""
    addrs = list(dict.fromkeys(addrs))
    if not addrs:
        return {}
    from concurrent.futures import ThreadPoolExecutor

    def one(addr: str) -> bool:
        budget = timeout if deadline is None else min(timeout, deadline - time.monotonic())
        if budget <= 0:
            return False
        host, _, port = addr.rpartition(":")
        return probe_health(host.strip("[]"), int(port), "/health", api_key, timeout=budget)

    with ThreadPoolExecutor(max_workers=min(MAX_PROBES, len(addrs))) as ex:
        return dict(zip(addrs, ex.map(one, addrs), strict=True))


def parse_addrs(text: str) -> list[str]:
    addrs = [a.strip() for a in text.split(",") if a.strip()]
    for a in addrs:
        host, sep, port = a.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise UsageError(
                f"--servers: {a!r} is not host:port",
                hint="e.g. --servers 10.0.0.1:30000,10.0.0.2:30000",
            )
    if not addrs:
        raise UsageError("--servers is empty", hint="give host:port,... or auto")
    return addrs


def explicit(addrs: list[str], backend: str | None, api_key: str | None) -> Found:
    """--servers host:port,...: every address must answer /health now."""
    status = healthy(addrs, api_key)
    dead = [a for a, ok in status.items() if not ok]
    if dead:
        raise UsageError(
            f"--servers: {', '.join(dead)} not reachable (no healthy answer on /health)",
            hint="check the address and that the server runs (areal ps), or use --servers auto",
        )
    return Found(addrs, backend or "sglang", api_key, [])


def from_registry(
    registry: Registry,
    home: Path,
    experiment: str,
    trial: str,
    min_servers: int,
    wait: float,
    on_progress: Callable[[int, float], None] | None = None,
) -> Found:
    """Healthy registered servers of E/T, waiting up to `wait` seconds for `min_servers`."""
    deadline = time.monotonic() + wait
    delay = 0.05
    while True:
        entries = _unique(registry.list(experiment, trial).servers)
        usable, key, skipped = trusted(home, entries)
        # At least a short round even when the wait is over (--wait-servers 0 still looks).
        round_end = max(deadline, time.monotonic() + 0.5)
        status = healthy([e.addr for e in usable], key, timeout=2.0, deadline=round_end)
        good = [e for e in usable if status.get(e.addr)]
        left = deadline - time.monotonic()
        if on_progress:
            on_progress(len(good), max(0.0, left))
        if len(good) >= min_servers:
            backends = {e.backend for e in good if e.backend}
            if len(backends) > 1:
                raise UsageError(
                    f"servers of {experiment}/{trial} run different backends: {sorted(backends)}",
                    hint="serve one backend per trial, or pick servers with --servers",
                )
            backend = backends.pop() if backends else "sglang"
            return Found([e.addr for e in good], backend, key, good, skipped)
        if left <= 0:
            where = registry.where(experiment, trial)
            why = "".join(f"\n  left out {addr}: {reason}" for addr, reason in skipped)
            raise WaitTimeout(
                f"found {len(good)} healthy server(s) of {experiment}/{trial}, need {min_servers}, "
                f"after waiting {wait:g}s; searched {where}" + why,
                hint=f"start them with: areal serve --model MODEL --experiment {experiment} "
                f"--trial {trial} --detach   (or pass --servers host:port,...)",
            )
        time.sleep(max(0.0, min(delay, left, 0.5)))
        delay *= 2


def _unique(entries: list[ServerEntry]) -> list[ServerEntry]:
    """One entry per address: two entries naming one server are one server."""
    seen: dict[str, ServerEntry] = {}
    for e in entries:
        seen.setdefault(e.addr, e)
    return list(seen.values())


def trusted(
    home: Path, entries: list[ServerEntry]
) -> tuple[list[ServerEntry], str | None, list[tuple[str, str]]]:
    """(servers to use, the key for them, servers left out with the reason).

    A key goes only to the servers of the job that stored it (same marker). When some
    servers need a key, the servers of one such job are used and every other server is
    left out: it would receive a key that is not its own."""
    keyed = [e for e in entries if e.api_key_required]
    if not keyed:
        return entries, None, []
    use: list[ServerEntry] = []
    key = None
    for e in keyed:
        if not e.job or "/" not in e.job:
            continue
        held = apikeys.load(apikeys.key_file(home, *e.job.split("/", 1)))
        if held and held[0] == e.marker:
            key = held[1]
            use = [x for x in keyed if x.marker == e.marker]
            break
    if key is None:
        plain = [e for e in entries if not e.api_key_required]
        return plain, None, [(e.addr, "needs an API key this user does not hold") for e in keyed]
    skipped = [
        (e.addr, "not started by the job whose API key the others need")
        for e in entries
        if e not in use
    ]
    return use, key, skipped
