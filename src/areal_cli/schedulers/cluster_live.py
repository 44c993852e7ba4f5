"""A cluster job's registered servers and its processes while it runs: what `areal ps` asks of
a live job (its registry entries, whether they answer and are paused), and what ending one
does (out of discovery, nothing left on this host, the servers its trainers paused resumed).
Kept apart from cluster.py, which `areal ps` imports for every cluster scheduler: threads,
http.client and psutil come only with a live or an ending job.
"""

from __future__ import annotations

import json
from pathlib import Path

from areal_cli import apikeys, backends, control, discovery, procs
from areal_cli.errors import ArealError
from areal_cli.registry import open_registry
from areal_cli.schedulers.common import resume_left_paused
from areal_cli.spec import Plan


def registered(rec) -> tuple[list, list, dict[str, bool], dict[str, bool | None]]:
    """A live job's servers and ranks in its registry (its marker's), whether each server
    answers, and whether it is paused."""
    try:
        reg = open_registry(rec.registry)
        entries = [e for e in reg.list(rec.experiment, rec.trial).servers
                   if e.marker == rec.marker]  # fmt: skip
        ranks = [r for r in reg.ranks(rec.experiment, rec.trial) if r.marker == rec.marker]
    except (ArealError, OSError):
        entries, ranks = [], []
    health: dict[str, bool] = {}
    paused: dict[str, bool | None] = {}
    if entries:
        held = apikeys.load(rec.api_key_file) if rec.api_key_file else None
        key = held[1] if held and held[0] == rec.marker else None
        if key:
            # Anyone who writes the registry can copy an entry of ours: only those the job
            # signed are its servers (and may be asked with its key).
            entries = [e for e in entries if apikeys.unproven(key, e) is None]
        health = discovery.healthy([e.addr for e in entries])
        backend = (entries[0].backend if entries else None) or backends.FALLBACK
        paused = control.paused_all([e.addr for e in entries], backend, key, 1.0)
    return entries, ranks, health, paused


def deregister_servers(rec, addrs: set[str]) -> int:
    """Take the job's servers at `addrs` out of discovery (a replica killed with SIGKILL never
    deregistered, and AReaL's reader would go on listing it). Returns the entries removed."""
    gone = 0
    try:
        reg = open_registry(rec.registry)
        for e in reg.list(rec.experiment, rec.trial, include_dead=True).servers:
            if e.managed and e.marker == rec.marker and e.addr in addrs:
                reg.deregister(rec.experiment, rec.trial, e.id, e.lease)
                gone += 1
    except (ArealError, OSError):
        pass  # its lease or heartbeat runs out anyway
    return gone


def leave_nothing(rec, home: Path, records, plan_file: str, left: list[str] | None = None) -> int:
    """An ended job: nothing of it stays in discovery, nothing of it runs on this host, what
    its trainers left paused is resumed, the record says how it ended. Returns the registry
    entries removed; what could not be removed is told in `left` (if given)."""
    gone = 0
    try:
        gone = open_registry(rec.registry).deregister_job(rec.experiment, rec.trial, rec.marker)
    except (ArealError, OSError) as e:
        if left is not None:  # the entries' leases (or heartbeats) run out anyway
            why = getattr(e, "message", None) or getattr(e, "strerror", None) or str(e)
            left.append(f"the job's registry entries in {rec.registry} were not removed "
                        f"({why}); they expire with their lease or heartbeat (the TTL)")  # fmt: skip
    procs.kill_job(rec.marker, grace=3.0)  # a task the cluster lost track of, on this host
    _resume_servers(rec, plan_file)
    records.write(home, rec)
    return gone


def _resume_servers(rec, plan_file: str) -> None:
    """What the job's trainers left paused (its plan says which servers they used)."""
    if rec.kind == "serve":
        return
    try:
        plan = Plan.from_json(json.loads((Path(rec.run_dir) / plan_file).read_text()))
    except (OSError, ValueError, TypeError):
        return
    resume_left_paused(plan)


def servers_by_node(plan) -> dict[str, list[int]]:
    """A job's own servers (a combined job's replicas) in the registry, by node: what its
    watchdog samples beside the ranks."""
    out: dict[str, list[int]] = {}
    try:
        entries = open_registry(plan.registry).list(plan.experiment, plan.trial).servers
    except Exception:
        return out
    for e in entries:
        if e.marker == plan.marker and e.node and e.pid:
            out.setdefault(e.node, []).append(e.pid)
    return out
