"""`areal ps`, `areal logs`, `areal stop`: manage what runs, through each scheduler."""

from __future__ import annotations

from pathlib import Path

import typer

from areal_cli import console, schedulers, settings
from areal_cli.commands import listing
from areal_cli.errors import UsageError, WaitTimeout
from areal_cli.logfiles import ROLES  # the one table of log roles (`--role` help, the reader)
from areal_cli.schedulers.api import LIVE, parse_name

from ._common import COLORS, HomeOpt, JsonOpt, LinePrinter, RegistryOpt


def register(app: typer.Typer) -> None:
    app.command("ps", help=PS_HELP)(ps)
    app.command("logs", help=LOGS_HELP)(logs)
    app.command("stop", help=STOP_HELP)(stop)


PS_HELP = """List jobs: state, processes, servers and whether each answers /health.

\b
Examples:
  areal ps
  areal ps --all --json | jq '.[].servers'
"""


def ps(
    all_: bool = listing.OPTIONS[0].option(),
    home: Path = HomeOpt,
    registry: str = RegistryOpt,
    json_out: bool = listing.OPTIONS[1].option(),
) -> None:
    listing.show(all_, home, json_out)


LOGS_HELP = """Show a job's logs, merged with a \\[server-N] / \\[rank-N] prefix.

\b
Examples:
  areal logs default/trial0
  areal logs myexp/trial0 -f --role rank --index 1
  areal logs myexp/trial0 -n 200 --role server
"""


def logs(
    name: str = typer.Argument(..., help="Job as EXPERIMENT/TRIAL (see areal ps)."),
    follow: bool = typer.Option(
        False, "--follow", "-f", help="Keep printing new lines until the job ends."
    ),
    role: str = typer.Option(None, "--role", "-r", help=" | ".join(ROLES) + "."),
    index: int = typer.Option(
        None, "--index", "-i", min=0, help="Only process/rank N of that role."
    ),
    lines: int = typer.Option(50, "--lines", "-n", min=0, help="Lines of history per file."),
    home: Path = HomeOpt,
    registry: str = RegistryOpt,
) -> None:
    sched, handle = _one_job(name, None, home)
    printer = LinePrinter(console.out)
    try:
        for label, line in sched.log_iter(handle, role, index, follow, lines):
            printer.colors.setdefault(label, COLORS[len(printer.colors) % len(COLORS)])
            printer(label, line)
    except KeyboardInterrupt:
        return


def _one_job(name: str, kind: str | None, home):
    """The job E/T names (the live one first), on whichever scheduler runs it."""

    found = _jobs_of(name, kind, home)
    if not found:
        exp, trial = parse_name(name)
        raise UsageError(
            f"no job {exp}/{trial}"
            + (f" of kind {kind}" if kind else "")
            + f" under {settings.home(home)}",
            hint="`areal ps --all` lists the jobs this home knows; --home / AREAL_HOME selects another.",
        )
    return found[0]


def _jobs_of(name: str, kind: str | None, home):
    exp, trial = parse_name(name)
    return schedulers.known_jobs(exp, trial, kind, home=settings.home(home))


STOP_HELP = """Stop a trial's jobs, every process they started and their registry entries.

Both the serve and the train job of the trial, or the one --kind names; grandchildren of
their processes go too.

\b
Examples:
  areal stop default/trial0
  areal stop myexp/trial0 --kind serve
  areal stop --all
"""


def stop(
    name: str = typer.Argument(None, help="Job as EXPERIMENT/TRIAL (see areal ps)."),
    all_: bool = typer.Option(False, "--all", help="Stop every running job of this user."),
    kind: str = typer.Option(None, "--kind", help="serve | train: only that job of the trial."),
    timeout: float = typer.Option(
        30.0, "--timeout", min=0.1, help="Seconds to wait for a clean stop."
    ),
    home: Path = HomeOpt,
    registry: str = RegistryOpt,
    json_out: bool = JsonOpt,
) -> None:
    if all_ == bool(name):
        raise UsageError(
            "give a job name or --all", hint="areal stop default/trial0 (see areal ps)"
        )
    if kind is not None and kind not in ("serve", "train"):
        raise UsageError(f"--kind {kind!r}: choose serve or train")
    home_dir = settings.home(home)
    targets = []
    if all_:
        here = settings.hostname()
        for sname in schedulers.names():
            sched = schedulers.get(sname, home=home_dir, registry=registry)
            targets += [
                (sched, j.handle)
                for j in sched.list()
                if j.state in LIVE and j.host in (here, None)
            ]
    else:
        found = _jobs_of(name, kind, home)
        if not found:
            _one_job(name, kind, home)  # raises the "no job" error with its hint
        live = []
        for sched, handle in found:
            try:
                job = sched.describe(handle)
            except WaitTimeout:
                # Its cluster does not answer: whether it runs is unknown, and its cancel
                # ends what it can without the cluster before it says so.
                live.append((sched, handle))
                continue
            if job is not None and job.state in LIVE:
                live.append((sched, handle))
        # Nothing runs: still sweep every job's leftovers (processes, registry entries).
        targets = live or found
    results = []
    for sched, handle in targets:
        with console.err.status(f"stopping {handle.name} ..."):
            results.append(sched.cancel(handle, timeout).to_json())
    if json_out:
        console.print_json(results)
    else:
        if not results:
            console.out.print("nothing to stop")
        for r in results:
            verb = "stopped" if r["was_running"] else "was not running; cleaned up"
            what = f"{r['killed']} leftover process(es) killed"
            if r.get("cancelled"):
                what = f"{r['cancelled']} cancelled"
            console.out.print(f"[green]{r['name']}[/] {verb} ({what}, "
                              f"{r['deregistered']} registry entries removed)")  # fmt: skip
            for why in r.get("left") or ():
                console.err.print(f"[yellow]left[/] {r['name']}: {why}")
    # Entries a registry kept expire by themselves; a process that outlived SIGKILL does not.
    running = [r["name"] for r in results if r.get("running")]
    if running:
        raise WaitTimeout(
            f"{', '.join(running)}: not every process stopped (see above)",
            hint="a process stuck in the kernel (state D) goes when its I/O returns",
        )
