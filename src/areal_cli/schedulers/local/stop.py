"""Ending a local job: `areal stop` (LocalScheduler.cancel), and the watchdog's teardown once
the supervisor died (reaper.py). Kept apart from the package so that `areal ps` never imports
psutil or a registry client for it."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from areal_cli import procs, settings
from areal_cli.errors import ArealError, UsageError, WaitTimeout
from areal_cli.registry import open_registry, registry_class
from areal_cli.schedulers.api import Handle, StopResult
from areal_cli.schedulers.local import records

if TYPE_CHECKING:
    from areal_cli.schedulers.local import LocalScheduler


def cancel(sched: LocalScheduler, handle: Handle, timeout: float = 30.0) -> StopResult:
    """LocalScheduler.cancel: SIGTERM the supervisor and wait; then make sure nothing of the
    job is left, and nothing of the trial's other job if that one is not running either."""
    rec = sched._record(handle)
    if rec.host != settings.hostname():
        # Its pids mean nothing here (a shared home seen from another node).
        raise UsageError(
            f"job {rec.name} runs on {rec.host}, not on this host ({settings.hostname()})",
            hint=f"run `areal stop {rec.name}` on {rec.host}",
        )
    was_running = rec.alive() and rec.state in records.LIVE
    if was_running:
        try:
            os.kill(rec.supervisor_pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        except PermissionError:
            # Another user's process holds the pid now: ours, which ran as us, is gone.
            was_running = False
        if was_running:
            procs.wait_until(lambda: not rec.alive(), timeout)
    # Only pids that are still the processes we started: an old record's pids may be reused.
    roots = [p.pid for p in rec.processes if procs.pid_alive(p.pid, p.create_time)]
    # And the servers now serving (a runner's restart changes the pid; a server whose
    # runner was killed is in no runner's tree): those with a create time to check it by.
    roots += [p.server_pid for p in rec.processes if p.server_pid and p.server_create_time
              and procs.pid_alive(p.server_pid, p.server_create_time)]  # fmt: skip
    killed = procs.kill_job(rec.marker, roots, grace=3.0)
    left: list[str] = []
    alive = sorted({p.pid for p in procs.find_marked(rec.marker)}
                   | {pid for pid in roots if procs.pid_alive(pid)})  # fmt: skip
    if alive:
        left.append(f"{len(alive)} process(es) still alive after SIGKILL: "
                    + " ".join(map(str, alive)))  # fmt: skip
    if was_running and rec.alive():
        alive.append(rec.supervisor_pid)
        left.append(f"its supervisor (pid {rec.supervisor_pid}) did not stop within "
                    f"{timeout:g}s")  # fmt: skip
    deregistered = 0
    for url in dict.fromkeys([rec.registry, settings.registry_url(sched.registry)]):
        got = _deregister(sched, url, rec, servers_gone=not alive)
        if isinstance(got, str):
            left.append(got)
        else:
            deregistered += got
    fresh = records.load(sched.home, rec.experiment, rec.trial, rec.kind)
    if fresh.state in records.LIVE:
        fresh.state = "stopped"
        fresh.message = "stopped by areal stop"
        records.write(sched.home, fresh)
    elif was_running and fresh.message == "terminated":
        # A foreground job knows only that a SIGTERM came: it was ours.
        fresh.message = "stopped by areal stop"
        records.write(sched.home, fresh)
    return StopResult(rec.name, was_running, killed, deregistered, left=left,
                      running=bool(alive))  # fmt: skip


def _deregister(
    sched: LocalScheduler, url: str, rec: records.JobRecord, servers_gone: bool
) -> int | str:
    """The job's entries removed from one registry: how many, or what was left and why."""
    fate = registry_class(url).leftovers_expire or (
        "readers skip such entries: their servers are gone"
        if servers_gone
        else "readers skip such entries once their heartbeat is older than the TTL"
    )
    why = sched._unanswered.get(url)
    if why is None:
        reg = open_registry(url)
        try:
            return reg.deregister_job(rec.experiment, rec.trial, rec.marker)
        except (ArealError, OSError) as e:
            why = getattr(e, "message", None) or getattr(e, "strerror", None) or str(e)
            if isinstance(e, WaitTimeout):
                sched._unanswered[url] = why
            else:
                try:
                    listed = reg.list(rec.experiment, rec.trial, include_dead=True).servers
                    n = sum(x.marker == rec.marker for x in listed)
                except (ArealError, OSError):
                    n = None
                if n == 0:
                    return 0
                if n is not None:
                    return f"{n} registry entr{'y' if n == 1 else 'ies'} left in {url} " \
                           f"({why}); {fate}"  # fmt: skip
    return f"the job's registry entries in {url} were not removed ({why}); {fate}"


def reap(marker: str, home: Path, experiment: str, trial: str, registry: str) -> None:
    """What the watchdog (reaper.py) does once the supervisor died without tearing down."""
    # The record first: from now on `ps` says what happened, not "dead".
    try:
        for rec in records.load_all(home, experiment, trial):
            if rec.marker == marker and rec.state in records.LIVE:
                rec.state = "killed"
                rec.message = "the supervisor died; the watchdog tore the job down"
                records.write(home, rec)
    except Exception:
        pass
    procs.kill_job(marker, grace=3.0)
    try:
        open_registry(registry).deregister_job(experiment, trial, marker)
    except Exception:
        pass  # entries expire with their lease or heartbeat anyway
