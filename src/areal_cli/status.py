"""What `ps` and `stop` need: job state joined with registry entries and live health."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from areal_cli import jobs, settings
from areal_cli.errors import UsageError
from areal_cli.registry import open_registry

LIVE = jobs.LIVE


def job_statuses(home: Path, include_ended: bool = False) -> list[dict]:
    records, bad = jobs.list_all(home)
    out = []
    for rec in records:
        alive = rec.alive()
        state = rec.state
        if state in LIVE and not alive:
            state = "dead"  # supervisor and watchdog both gone without a word
        if not include_ended and state not in LIVE:
            continue
        out.append((rec, state))
    here = settings.hostname()
    probes = []
    for rec, _ in out:
        for p in rec.processes:
            if p.role == "server" and p.addr and rec.host == here:
                probes.append(p.addr)
    health = {}
    if probes:
        from areal_cli import discovery  # threads and http.client: only to probe servers

        health = discovery.healthy(probes, timeout=1.0)
    result = []
    for rec, state in out:
        servers = [
            {"addr": p.addr, "pid": p.pid, "gpus": p.gpus, "healthy": bool(state in LIVE and health.get(p.addr)),
             "exit_code": p.exit_code}
            for p in rec.processes
            if p.role == "server" and p.addr
        ]  # fmt: skip
        d = {
            "name": rec.name,
            "experiment": rec.experiment,
            "trial": rec.trial,
            "kind": rec.kind,
            "state": state,
            "host": rec.host,
            "pids": [rec.supervisor_pid, *rec.pids],
            "supervisor_pid": rec.supervisor_pid,
            "servers": servers,
            "started": rec.started,
            "log_dir": rec.log_dir,
            "alloc": rec.alloc,
            "model": rec.model,
            "message": rec.message,
        }
        result.append(d)
    for path in bad:
        result.append({"name": path, "experiment": None, "trial": None, "kind": None,
                       "state": "corrupt", "pids": [], "servers": [], "started": 0.0,
                       "message": "unreadable job record"})  # fmt: skip
    return result


def stop_job(home: Path, rec: jobs.JobRecord, timeout: float, registry: str) -> dict:
    """SIGTERM the supervisor and wait; then make sure nothing of the job is left."""
    from areal_cli import procs  # psutil: `ps` with no jobs never needs it

    if rec.host != settings.hostname():
        # Its pids mean nothing here (a shared home seen from another node).
        raise UsageError(
            f"job {rec.name} runs on {rec.host}, not on this host ({settings.hostname()})",
            hint=f"run `areal stop {rec.name}` on {rec.host}",
        )
    was_running = rec.alive() and rec.state in LIVE
    if was_running:
        try:
            os.kill(rec.supervisor_pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        procs.wait_until(lambda: not rec.alive(), timeout)
    # Only pids that are still the processes we started: an old record's pids may be reused.
    roots = [p.pid for p in rec.processes if procs.pid_alive(p.pid, p.create_time)]
    killed = procs.kill_job(rec.marker, roots, grace=3.0)
    deregistered = 0
    for url in {rec.registry, registry}:
        deregistered += open_registry(url).deregister_job(rec.experiment, rec.trial, rec.marker)
    fresh = jobs.load(home, rec.experiment, rec.trial, rec.kind)
    if fresh.state in LIVE:
        fresh.state = "stopped"
        fresh.message = "stopped by areal stop"
        jobs.write(home, fresh)
    return {
        "name": rec.name,
        "was_running": was_running,
        "killed": killed,
        "deregistered": deregistered,
    }
