"""Where the doctor meets the schedulers: the doctor (areal_cli.diagnose) imports no scheduler,
so what it needs of one is looked up here and handed to it as data and callables:

- a job named by the user (`--job E/T`): its record (the scheduler's status of it) and, for a
  job on a cluster's nodes, the way to reach them (the scheduler's run_on_nodes, the lead its
  nodes need to start at one moment, how it names the job);
- `doctor check`: the scheduler's own rows, and which job markers the local scheduler still
  runs (a process marked with another is a leftover).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from areal_cli import schedulers, settings
from areal_cli.diagnose import job_ranks, targets
from areal_cli.errors import UsageError
from areal_cli.schedulers.api import LIVE


def resolve(
    pids: list[int] | None = None, job: str | None = None, home: str | Path | None = None
) -> list[targets.Job]:
    """The jobs `doctor hang|diverge|memory|profile` look at: the job of record `job`, the
    ranks of `pids`, or every job of this user on this host."""
    if home is not None:
        settings.home(home)  # a --home that names no folder is refused even when unused
    if job:
        return [job_target(job, home)]
    return targets.resolve(pids=pids)


def job_target(name: str, home: str | Path | None = None) -> targets.Job:
    """The ranks of the job E/T (its training job if it has one: that is where ranks live),
    found through its scheduler's record; UsageError (exit 2) when there is none."""
    parts = name.strip("/").split("/")
    if len(parts) != 2 or not all(parts):
        raise UsageError(f"job name {name!r} is not EXPERIMENT/TRIAL", hint="see `areal ps`")
    found = schedulers.known_jobs(*parts, home=settings.home(home))
    jobs = [(s, s.describe(h)) for s, h in found]
    jobs = [(s, j) for s, j in jobs if j is not None]
    if not jobs:
        raise UsageError(
            f"no job {name} under {settings.home(home)}",
            hint="`areal ps --all` lists the jobs this home knows",
        )
    sched, record = next(((s, j) for s, j in jobs if j.handle.kind != "serve"), jobs[0])
    if sched.reaches_nodes and record.handle.job_id:
        what = f"{sched.label or sched.name} job {record.handle.job_id}"
        return job_ranks.from_record(
            record, reach=sched.run_on_nodes, lead=sched.node_start_s, what=what
        )
    return job_ranks.from_record(record)


def check_inputs(
    scheduler: str | None, home: str | Path | None, registry: str | Path | None
) -> dict[str, Callable]:
    """What `doctor check` (diagnose.check.run_checks) asks of the schedulers, as callables:
    `live_markers` (the markers of the local jobs still live) and, with a scheduler named,
    `scheduler_rows` (its own rows, given the registry's URL)."""
    out: dict[str, Callable] = {"live_markers": lambda: live_markers(settings.home(home))}
    if scheduler:
        out["scheduler_rows"] = lambda url: schedulers.get(
            scheduler, home=settings.home(home), registry=registry
        ).check_rows(url)
    return out


def live_markers(home: Path) -> set[str]:
    """The job markers of the local scheduler's live jobs."""
    return {j.marker for j in schedulers.get("local", home=home).list() if j.state in LIVE}
