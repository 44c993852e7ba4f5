"""What the doctor's commands on a live job share: the --pid and --job options, the jobs they
name (their scheduler's records read by areal_cli.schedulers.doctor_targets), reports as JSON."""

from __future__ import annotations

import typer

from areal_cli import console
from areal_cli.diagnose import targets
from areal_cli.errors import UsageError
from areal_cli.schedulers import doctor_targets

PID_HELP = "A rank, or a launcher (torchrun, areal) whose workers to read. Repeatable."
JOB_HELP = "A job record EXPERIMENT/TRIAL (see `areal ps`)."
PidOpt = typer.Option(None, "--pid", "-p", help=PID_HELP)
JobOpt = typer.Option(None, "--job", "-j", help=JOB_HELP)
HomeOpt = typer.Option(None, "--home", help="AREAL_HOME holding job records (for --job).")


def find_jobs(pid: list[int] | None, job: str | None, home: str | None) -> list[targets.Job]:
    """The jobs --pid or --job name (neither: every job of this user on this host)."""
    if pid and job:
        raise UsageError("give --pid or --job, not both")
    return doctor_targets.resolve(pids=list(pid or []), job=job, home=home)


def print_json(reports: list) -> None:
    """One job's report as it is; several under "jobs"."""
    data = [r.to_json() for r in reports]
    console.print_json(data[0] if len(data) == 1 else {"jobs": data})
