"""Schedulers: where a job's processes run. Each is a plug-in of entry-point group
`areal_cli.schedulers` (plugins.py): areal ships `local` (processes on this host), `slurm` (a
batch job on a Slurm cluster) and `ray` (detached actors on a Ray cluster), each one module
behind the same API (api.py), imported only when used; an installed distribution adds more.

    sched = get("slurm")                     # --scheduler, job YAML, AREAL_SCHEDULER
    request = sched.dryrun(spec)             # --dry-run prints it
    handle = sched.schedule(request, detach=True)
"""

from __future__ import annotations

import os
from pathlib import Path

from areal_cli import plugins, settings
from areal_cli.errors import UsageError

# typing's TYPE_CHECKING without importing typing (5 ms of `areal ps`).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from areal_cli.schedulers.api import Handle, RunOpt, Scheduler

DEFAULT = "local"
# The folder under AREAL_HOME that names, one empty file each, the schedulers that ran a job
# from this home: `areal ps` imports those only (a scheduler's module costs 15-50 ms).
USED = "schedulers"


def names() -> list[str]:
    """One name of each installed scheduler."""
    return plugins.names(plugins.SCHEDULERS)


def pick(flag: str | None, config: dict | None = None) -> str:
    """The scheduler's name: the flag, else the job YAML's `scheduler`, else AREAL_SCHEDULER."""
    name = flag or (config or {}).get("scheduler") or os.environ.get("AREAL_SCHEDULER") or DEFAULT
    plugins.check(plugins.SCHEDULERS, name)
    return name


def scheduler_class(name: str) -> type[Scheduler]:
    """The class of scheduler `name`, its module imported now (a UsageError naming the valid
    names, or the entry point that does not load)."""
    from areal_cli.schedulers.api import Scheduler

    return plugins.load(plugins.SCHEDULERS, name, base=Scheduler)


def flagged_runopts() -> list[RunOpt]:
    """The run options of every installed scheduler that name a flag (RunOpt.flag), one per
    flag: the flags `serve` and `train` take beside their own. A scheduler that does not load
    is left out (choosing it says why)."""
    declared = []
    for n in sorted(names()):
        try:
            cls = scheduler_class(n)
        except UsageError:
            continue
        declared.append((cls.label or cls.name, cls.runopts))
    return merge_flagged(declared)


def merge_flagged(declared: list[tuple[str, tuple[RunOpt, ...]]]) -> list[RunOpt]:
    """One RunOpt per flag of the options each scheduler declares (`declared`: its label and
    runopts), in the order first declared. Schedulers that declare one flag must agree on
    its name and kind, else a UsageError names them."""
    by_flag: dict[str, list[tuple[str, RunOpt]]] = {}
    for who, opts in declared:
        for o in opts:
            if o.flag:
                by_flag.setdefault(o.flag, []).append((who, o))
    out = [_one_flag(flag, owners) for flag, owners in by_flag.items()]
    flags: dict[str, str] = {}
    for o in out:
        if flags.setdefault(o.name, o.flag) != o.flag:
            raise _clash(f"run option {o.name} has two flags, {flags[o.name]} and {o.flag}")
    return out


def _one_flag(flag: str, owners: list[tuple[str, RunOpt]]) -> RunOpt:
    """The option of `flag` that every scheduler in `owners` declares: its help theirs,
    each one named where they differ; its default theirs where they agree, else none (each
    scheduler applies its own)."""
    from areal_cli.schedulers.api import RunOpt

    (who, first), others = owners[0], owners[1:]
    for other, o in others:
        if (o.name, o.kind) != (first.name, first.kind):
            raise _clash(
                f"flag {flag} is {who}'s option {first.name} ({first.kind}) and "
                f"{other}'s {o.name} ({o.kind})"
            )
    if all(o.help == first.help for _, o in others):
        text = first.help
    else:
        text = "; ".join(f"{w}: {o.help}" for w, o in owners)
    same = all(o.default == first.default for _, o in others)
    return RunOpt(first.name, first.kind, text, flag, first.default if same else None)


def _clash(message: str) -> UsageError:
    return UsageError(
        message,
        hint="schedulers that share a flag declare one option (name and kind): rename a "
        "plug-in's flag, or leave its option to --scheduler-opt",
    )


def get(name: str | None = None, **options) -> Scheduler:
    """The scheduler `name` (None: pick's choice), its module imported now. `options`:
    home=, registry=."""
    return scheduler_class(name or pick(None))(**options)


def note_used(home: Path, name: str) -> None:
    """Remember that scheduler `name` runs a job from this home (see USED). The first time,
    the schedulers whose records a home from before the index holds are noted too."""
    index = Path(home) / USED
    older = [] if index.is_dir() else [s.name for s in _with_records(Path(home))]
    index = settings.ensure_dir(index)
    for n in dict.fromkeys([name, *older]):
        if Path(n).name == n:  # else not a file name; no plug-in is named so
            (index / n).touch(mode=0o600)  # private, whatever the umask


def used(home: Path) -> list[Scheduler]:
    """The schedulers that may have records in this home (imported only then)."""
    home = Path(home)
    try:
        noted = sorted(os.listdir(home / USED))
    except (FileNotFoundError, NotADirectoryError):
        noted = None
    if noted is not None:
        # A name no installed scheduler has any more: its plug-in was uninstalled.
        return [get(n, home=home) for n in noted if n in _all_names()]
    return _with_records(home)


def _with_records(home: Path) -> list[Scheduler]:
    """Every scheduler whose records folder this home holds (each imported to ask it)."""
    try:
        with os.scandir(home) as it:
            folders = {e.name for e in it if e.is_dir()}
    except OSError:
        return []
    out = []
    for n in names() if folders else ():
        cls = scheduler_class(n)
        if (cls.records or cls.name) in folders:
            out.append(cls(home=home))
    return out


def _all_names() -> set[str]:
    """Every name, aliases included."""
    return {a for n in names() for a in plugins.aliases(plugins.SCHEDULERS, n)}


def known_jobs(
    experiment: str, trial: str, kind: str | None = None, **options
) -> list[tuple[Scheduler, Handle]]:
    """Every scheduler's jobs of E/T (of `kind` if given): the default's first."""
    found = []
    for name in sorted(names(), key=lambda n: n != DEFAULT):
        sched = get(name, **options)
        found += [(sched, h) for h in sched.find(experiment, trial, kind)]
    return found
