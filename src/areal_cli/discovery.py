"""Finding inference servers for a training job: the registry (waiting for them) or a list.

Only servers we may trust get the job's API key: those whose registry entry is signed, for
the address it names and within its TTL, with the key of the job that holds it (see apikeys):
anyone who can write the registry (every user of an etcd without auth) can copy an entry, and
a copy pointing at their own server is left out before a single request carries the key. Probing honours the caller's deadline: many probes run at
once, each bounded by the time that is left.

A paused server would hold every request of a new trainer forever. When no trainer of the
trial is alive (its rank table is empty), a paused server is one a dead trainer left
mid-sync: it is resumed and used, and the caller is told. While a trainer of the trial
lives, its servers may be paused for its own weight sync: they are left out, with the
reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from areal_cli import apikeys, control
from areal_cli.backends import FALLBACK
from areal_cli.errors import UsageError, WaitTimeout
from areal_cli.health import PROBE_TIMEOUT, probe_health
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
    # Servers found paused with no trainer of the trial alive, and resumed.
    resumed: list[str] = field(default_factory=list)
    # False: `backend` is assumed (no server of --servers said which engine it runs).
    backend_known: bool = True


def healthy(
    addrs: list[str],
    api_key: str | None = None,
    timeout: float = PROBE_TIMEOUT,
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
    if backend is None:
        backend = _identified(addrs, api_key)
    return Found(addrs, backend or FALLBACK, api_key, [], backend_known=backend is not None)


def _identified(addrs: list[str], api_key: str | None) -> str | None:
    """The one engine every address says it is (None: none could tell); servers of
    different engines in one list are a usage error, as the workers speak one protocol."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(MAX_PROBES, len(addrs))) as ex:
        said = dict(zip(addrs, ex.map(lambda a: control.identify(a, api_key), addrs), strict=True))
    kinds = set(said.values()) - {None}
    if len(kinds) > 1:
        raise UsageError(
            "--servers: "
            + ", ".join(f"{a} is {b or 'unknown'}" for a, b in said.items())
            + ": one job's servers run one engine",
            hint="give the servers of one engine",
        )
    return kinds.pop() if kinds else None


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
        # Proven first, one per address after: a forged entry naming our server's address
        # must not push the real one out.
        usable, key, skipped = trusted(home, registry.list(experiment, trial).servers)
        usable = _unique(usable)
        skipped = [(addr, why) for addr, why in skipped if addr not in {e.addr for e in usable}]
        # At least a short round even when the wait is over (--wait-servers 0 still looks).
        # A round is long enough for SGLang's /health (health.PROBE_TIMEOUT: it takes 1 s).
        round_end = max(deadline, time.monotonic() + PROBE_TIMEOUT)
        status = healthy([e.addr for e in usable], key, deadline=round_end)
        good = [e for e in usable if status.get(e.addr)]
        # Paused servers: a vLLM one answers /health, an hf or SGLang one does not (its
        # /health waits for a token the pause holds back): those count when too few are
        # healthy. Entries without our metadata (AReaL's) are not asked.
        maybe = good if len(good) >= min_servers else good + [
            e for e in usable if not status.get(e.addr) and e.backend
        ]  # fmt: skip
        resumed: list[str] = []
        if maybe:
            kept, resumed, held = _unpause(registry, experiment, trial, maybe, key, round_end)
            good = [e for e in kept if status.get(e.addr) or e.addr in resumed]
            skipped = [*skipped, *held]
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
            backend = backends.pop() if backends else FALLBACK
            return Found([e.addr for e in good], backend, key, good, skipped, resumed)
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


def _unpause(
    registry: Registry,
    experiment: str,
    trial: str,
    good: list[ServerEntry],
    key: str | None,
    deadline: float,
) -> tuple[list[ServerEntry], list[str], list[tuple[str, str]]]:
    """(servers to use, those of them resumed, paused ones left out with the reason). Every
    question is bounded by the caller's deadline (with a short minimum)."""
    from concurrent.futures import ThreadPoolExecutor

    def budget() -> float:
        return max(0.2, min(2.0, deadline - time.monotonic()))

    with ThreadPoolExecutor(max_workers=min(MAX_PROBES, len(good))) as ex:
        flags = list(ex.map(lambda e: control.paused(e.addr, e.backend or FALLBACK, key,
                                                     budget()), good))  # fmt: skip
    stuck = [e for e, flag in zip(good, flags, strict=True) if flag is True]
    if not stuck:
        return good, [], []
    try:
        training = bool(registry.ranks(experiment, trial))
    except Exception:
        training = True  # cannot tell: do not resume under a trainer's feet
    if training:
        why = f"paused, and a trainer of {experiment}/{trial} is alive (its weight sync?)"
        return [e for e in good if e not in stuck], [], [(e.addr, why) for e in stuck]
    with ThreadPoolExecutor(max_workers=min(MAX_PROBES, len(stuck))) as ex:
        took = list(ex.map(lambda e: control.resume(e.addr, e.backend or FALLBACK, key,
                                                    budget()), stuck))  # fmt: skip
    resumed = [e.addr for e, ok in zip(stuck, took, strict=True) if ok]
    refused = [e for e, ok in zip(stuck, took, strict=True) if not ok]
    why = "paused, and it did not take a resume"
    return [e for e in good if e not in refused], resumed, [(e.addr, why) for e in refused]


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

    A key goes only to the servers of the job that stored it (same marker) whose entries
    prove it with a fresh signature under that key. When some servers need a key, the
    servers of one such job are used and every other server is left out: it would receive
    a key that is not its own."""
    keyed = [e for e in entries if e.api_key_required]
    if not keyed:
        return entries, None, []
    key = marker = None
    for e in keyed:
        if not e.job or "/" not in e.job:
            continue
        held = apikeys.load(apikeys.key_file(home, *e.job.split("/", 1)))
        if held and held[0] == e.marker:
            marker, key = held
            break
    if key is None:
        plain = [e for e in entries if not e.api_key_required]
        return plain, None, [(e.addr, "needs an API key this user does not hold") for e in keyed]
    use: list[ServerEntry] = []
    skipped: list[tuple[str, str]] = []
    now = time.time()
    for e in entries:
        if not (e.api_key_required and e.marker == marker):
            skipped.append((e.addr, "not started by the job whose API key the others need"))
        elif why := apikeys.unproven(key, e, now):
            skipped.append((e.addr, why))
        else:
            use.append(e)
    return use, key, skipped
