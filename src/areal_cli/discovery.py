"""Finding inference servers for a training job: the registry (waiting for them) or a list."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from areal_cli import jobs
from areal_cli.errors import UsageError, WaitTimeout
from areal_cli.health import probe_health
from areal_cli.registry import Registry, ServerEntry


@dataclass(frozen=True)
class Found:
    addrs: list[str]
    backend: str
    api_key: str | None
    entries: list[ServerEntry]


def healthy(addrs: list[str], api_key: str | None = None, timeout: float = 2.0) -> dict[str, bool]:
    if not addrs:
        return {}
    from concurrent.futures import ThreadPoolExecutor

    def one(addr: str) -> bool:
        host, _, port = addr.rpartition(":")
        return probe_health(host.strip("[]"), int(port), "/health", api_key, timeout=timeout)

    with ThreadPoolExecutor(max_workers=min(16, len(addrs))) as ex:
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
        entries = registry.list(experiment, trial).servers
        key = _api_key(home, entries)
        status = healthy([e.addr for e in entries], key, timeout=1.0)
        good = [e for e in entries if status.get(e.addr)]
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
            return Found([e.addr for e in good], backend, key, good)
        if left <= 0:
            where = registry.where(experiment, trial)
            raise WaitTimeout(
                f"found {len(good)} healthy server(s) of {experiment}/{trial}, need {min_servers}, "
                f"after waiting {wait:g}s; searched {where}",
                hint=f"start them with: areal serve --model MODEL --experiment {experiment} "
                f"--trial {trial} --detach   (or pass --servers host:port,...)",
            )
        time.sleep(min(delay, left, 0.5))
        delay *= 2


def _api_key(home: Path, entries: list[ServerEntry]) -> str | None:
    """Servers that need a key were started by a job of ours that stored it (user-only file)."""
    for e in entries:
        if e.api_key_required and e.job:
            try:
                for rec in jobs.load_all(home, *jobs.parse_name(e.job)):
                    if rec.api_key_file and Path(rec.api_key_file).exists():
                        return Path(rec.api_key_file).read_text().strip()
            except (UsageError, OSError):
                continue
    return None
