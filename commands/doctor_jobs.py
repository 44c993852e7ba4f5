"""What the doctor's commands on a live job share: the --pid, --job, --home and --registry
options, the jobs they name (their scheduler's records read by
areal_cli.schedulers.doctor_targets), reports as JSON."""

from __future__ import annotations

import inspect

import typer

from areal_cli import console
from areal_cli.diagnose import targets
from areal_cli.errors import UsageError
from areal_cli.schedulers import doctor_targets

from ._common import RegistryOpt

PID_HELP = "A rank, or a launcher (torchrun, areal) whose workers to read. Repeatable."
JOB_HELP = "A job record EXPERIMENT/TRIAL (see `areal ps`)."
PidOpt = typer.Option(None, "--pid", "-p", help=PID_HELP)
JobOpt = typer.Option(None, "--job", "-j", help=JOB_HELP)
HomeOpt = typer.Option(None, "--home", help="AREAL_HOME holding job records (for --job).")
# The options that name the jobs, around a command's own: --pid and --job first, --home and
# --registry last (the order `--help` shows).
_FIRST = (("pid", list[int], PidOpt), ("job", str, JobOpt))
_LAST = (("home", str, HomeOpt), ("registry", str, RegistryOpt))


def live_job_command(func):
    """`func` (a doctor command on live jobs) with the options that name its jobs added to its
    signature, where typer reads a command's options: declared once, here. `func` takes them
    as keyword arguments (`**target`) and hands them to find_jobs."""

    def shared(options):
        return [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=opt,
                                  annotation=kind) for name, kind, opt in options]  # fmt: skip

    own = [
        p
        for p in inspect.signature(func, eval_str=True).parameters.values()
        if p.kind is not p.VAR_KEYWORD
    ]
    func.__signature__ = inspect.Signature(shared(_FIRST) + own + shared(_LAST))
    return func


def find_jobs(target: dict) -> list[targets.Job]:
    """The jobs --pid or --job name (neither: every job of this user on this host); `target`:
    the options live_job_command adds (--registry is in force already, by its callback)."""
    pid, job = target["pid"], target["job"]
    if pid and job:
        raise UsageError("give --pid or --job, not both")
    return doctor_targets.resolve(pids=list(pid or []), job=job, home=target["home"])


def print_json(reports: list) -> None:
    """One job's report as it is; several under "jobs"."""
    data = [r.to_json() for r in reports]
    console.print_json(data[0] if len(data) == 1 else {"jobs": data})
