"""What the live jobs of `areal ps` say of themselves: whether their servers answer and are
paused, their registry entries (errors, restarts) and how many of their ranks are alive. Only
a listing with a live job imports this module (threads, http.client, the registry)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from areal_cli import apikeys, control, discovery, settings
from areal_cli.errors import ArealError, WaitTimeout
from areal_cli.parallel import ParallelDims
from areal_cli.registry import open_registry
from areal_cli.schedulers.local import records


def probe(rows: list, probe: bool, unanswered: dict[str, str]) -> tuple[dict, dict, dict, dict]:
    """(addr → healthy, addr → paused, marker → (ranks alive, world size), addr → registry
    entry) of the live jobs among `rows` ((record, state) pairs). probe=False: a server its
    runner registered (the supervisor then recorded its pid) counts as healthy and not paused,
    unasked. A registry that does not answer is noted in `unanswered` and not asked again."""
    here = settings.hostname()
    probes = [
        p.addr
        for rec, state in rows
        for p in rec.processes
        if p.role == "server" and p.addr and rec.host == here and state in records.LIVE
    ]
    health: dict[str, bool] = {}
    paused: dict[str, bool] = {}
    if not probe:
        health = {p.addr: True for rec, _ in rows for p in rec.processes
                  if p.role == "server" and p.addr in probes and p.server_pid}  # fmt: skip
    elif probes:
        with ThreadPoolExecutor(max_workers=1) as ex:
            asked = ex.submit(_paused_servers, rows, here)
            health = discovery.healthy(probes)
            paused = asked.result()
    live = [rec for rec, state in rows if state in records.LIVE]
    return health, paused, _live_ranks(live, unanswered), _server_entries(live, unanswered)


def _paused_servers(rows: list, here: str) -> dict[str, bool]:
    """addr → paused, for the live servers of these jobs that registered once (a server still
    loading is not ready either, and not paused)."""
    asks = []
    for rec, state in rows:
        if rec.host != here or state not in records.LIVE:
            continue
        held = apikeys.load(rec.api_key_file) if rec.api_key_file else None
        key = held[1] if held and held[0] == rec.marker else None
        for p in rec.processes:
            backend = control.backend_of(p.argv)
            if p.role == "server" and p.addr and p.server_pid and backend:
                asks.append((p.addr, backend, key))
    if not asks:
        return {}
    with ThreadPoolExecutor(max_workers=min(32, len(asks))) as ex:
        got = ex.map(lambda a: control.paused(a[0], a[1], a[2], timeout=1.0), asks)
        return {a[0]: flag is True for a, flag in zip(asks, got, strict=True)}


def _server_entries(recs: list, unanswered: dict[str, str]) -> dict:
    """addr → its registry entry, where its runner puts the requests it answered with
    errors lately (areal_cli.request_errors) and its restarts; the job's own (its marker)."""
    out: dict[str, dict] = {}
    for rec in recs:
        if rec.registry in unanswered or not any(p.role == "server" for p in rec.processes):
            continue
        try:
            entries = open_registry(rec.registry).list(rec.experiment, rec.trial).servers
        except WaitTimeout as e:
            unanswered[rec.registry] = e.message
            continue
        except (ArealError, OSError):
            continue
        out.update({e.addr: e for e in entries if e.marker == rec.marker})
    return out


def _live_ranks(
    recs: list[records.JobRecord], unanswered: dict[str, str]
) -> dict[str, tuple[int, int]]:
    """marker → (ranks alive, world size) from the registry's rank table, per training job.
    A registry that does not answer is noted in `unanswered` and not asked again."""
    if not any(rec.kind != "serve" for rec in recs):
        return {}
    out: dict[str, tuple[int, int]] = {}
    for rec in recs:
        if rec.kind == "serve" or rec.registry in unanswered:
            continue
        try:
            world = ParallelDims.from_alloc(rec.alloc).world_size if rec.alloc else 0
            alive = [r for r in open_registry(rec.registry).ranks(rec.experiment, rec.trial)
                     if r.marker == rec.marker]  # fmt: skip
        except WaitTimeout as e:
            unanswered[rec.registry] = e.message
            continue
        except (ArealError, OSError):
            continue
        out[rec.marker] = (len(alive), alive[0].world_size if alive else world)
    return out
