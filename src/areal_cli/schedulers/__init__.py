"""Schedulers: where a job's processes run. `local` (processes on this host), `slurm` (a
batch job on a Slurm cluster) and `ray` (detached actors on a Ray cluster), each one module
behind the same API (api.py), imported only when used.

    sched = get("slurm")                     # --scheduler, job YAML, AREAL_SCHEDULER
    request = sched.dryrun(spec)             # --dry-run prints it
    handle = sched.schedule(request, detach=True)
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from areal_cli.errors import UsageError

if TYPE_CHECKING:
    from areal_cli.schedulers.api import Handle, Scheduler

NAMES = {"local": "LocalScheduler", "slurm": "SlurmScheduler", "ray": "RayScheduler"}
DEFAULT = "local"
# Where under AREAL_HOME each scheduler keeps its job records: a scheduler with no folder
# there has never run a job from this home, and `areal ps` need not even import it.
RECORDS = {"local": "jobs", "slurm": "slurm", "ray": "ray"}


def pick(flag: str | None, config: dict | None = None) -> str:
    """The scheduler's name: the flag, else the job YAML's `scheduler`, else AREAL_SCHEDULER."""
    name = flag or (config or {}).get("scheduler") or os.environ.get("AREAL_SCHEDULER") or DEFAULT
    if name not in NAMES:
        raise UsageError(f"unknown scheduler {name!r}", hint="choose one of: " + ", ".join(NAMES))
    return name


def get(name: str | None = None, **options) -> Scheduler:
    """The scheduler `name`, its module imported now. `options`: home=, registry=."""
    name = pick(name)
    module = importlib.import_module(f"areal_cli.schedulers.{name}")
    return getattr(module, NAMES[name])(**options)


def used(home: Path) -> list[Scheduler]:
    """The schedulers that have records in this home (imported only then)."""
    return [get(name, home=home) for name in NAMES if (Path(home) / RECORDS[name]).is_dir()]


def known_jobs(
    experiment: str, trial: str, kind: str | None = None, **options
) -> list[tuple[Scheduler, Handle]]:
    """Every scheduler's jobs of E/T (of `kind` if given): the local ones first."""
    found = []
    for name in NAMES:
        sched = get(name, **options)
        found += [(sched, h) for h in sched.find(experiment, trial, kind)]
    return found
