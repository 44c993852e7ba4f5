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
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from areal_cli.errors import ArealError, ArealWarning, UsageError

if TYPE_CHECKING:
    from areal_cli.schedulers.api import Handle, Scheduler

# name -> "module:Class". A scheduler from elsewhere is one line in the environment:
# AREAL_SCHEDULERS="name=package.module:Class[,...]" (read once, at import).
PLUGINS_ENV = "AREAL_SCHEDULERS"
NAMES = {
    "local": "areal_cli.schedulers.local:LocalScheduler",
    "slurm": "areal_cli.schedulers.slurm:SlurmScheduler",
    "ray": "areal_cli.schedulers.ray:RayScheduler",
}
DEFAULT = "local"
# Where under AREAL_HOME each scheduler keeps its job records: a scheduler with no folder
# there has never run a job from this home, and `areal ps` need not even import it. A
# plug-in keeps its records under its own name.
RECORDS = {"local": "jobs", "slurm": "slurm", "ray": "ray"}


# name -> the AREAL_SCHEDULERS entry that put it in NAMES, so an entry that does not load
# is named as the user wrote it.
_ENTRIES: dict[str, str] = {}


def _plugins() -> None:
    for item in filter(None, (x.strip() for x in os.environ.get(PLUGINS_ENV, "").split(","))):
        name, sep, target = item.partition("=")
        name, target = name.strip(), target.strip()
        module, _, cls = target.partition(":")
        if not sep or not name or not module.strip() or not cls.strip():
            raise UsageError(
                f"{PLUGINS_ENV}: {item!r} is not NAME=MODULE:CLASS",
                hint=f"e.g. {PLUGINS_ENV}=k8s=mypkg.k8s_scheduler:K8sScheduler",
            )
        if name in NAMES and name not in _ENTRIES and NAMES[name] != target:
            # Legitimate (a site's own local scheduler), but a job that behaves unlike the
            # built-in one must not leave the user guessing why.
            warnings.warn(
                f"{PLUGINS_ENV}: {item!r} replaces the built-in {name!r} scheduler ({NAMES[name]})",
                ArealWarning,
                stacklevel=2,
            )
        NAMES[name] = target
        _ENTRIES[name] = item
        RECORDS.setdefault(name, name)


_plugins()


def pick(flag: str | None, config: dict | None = None) -> str:
    """The scheduler's name: the flag, else the job YAML's `scheduler`, else AREAL_SCHEDULER."""
    name = flag or (config or {}).get("scheduler") or os.environ.get("AREAL_SCHEDULER") or DEFAULT
    if name not in NAMES:
        raise UsageError(f"unknown scheduler {name!r}", hint="choose one of: " + ", ".join(NAMES))
    return name


def scheduler_class(name: str) -> type[Scheduler]:
    """The class of scheduler `name` (a name pick() chose), its module imported now."""
    if name not in NAMES:
        pick(name)  # the message naming the schedulers there are
    module, _, cls = NAMES[name].partition(":")
    where = f"{PLUGINS_ENV} entry {_ENTRIES[name]!r}" if name in _ENTRIES else f"scheduler {name!r}"
    try:
        found = getattr(importlib.import_module(module), cls)
    except ArealError:
        raise
    except Exception as e:  # a plug-in's module may raise anything while it imports
        raise UsageError(
            f"{where}: cannot load {NAMES[name]} ({type(e).__name__}: {e})",
            hint=f"check {PLUGINS_ENV} and that the module is importable here",
        ) from None
    from areal_cli.schedulers.api import Scheduler

    if not (isinstance(found, type) and issubclass(found, Scheduler)):
        raise UsageError(
            f"{where}: {NAMES[name]} is not a scheduler class",
            hint=f"{PLUGINS_ENV} names a subclass of areal_cli.schedulers.api.Scheduler",
        )
    return found


def get(name: str | None = None, **options) -> Scheduler:
    """The scheduler `name` (None: pick's choice), its module imported now. `options`:
    home=, registry=."""
    return scheduler_class(name if name in NAMES else pick(name))(**options)


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
