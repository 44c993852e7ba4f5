"""`areal doctor hang`: its options, its run and the typer command built from both.

The options are one table (OPTIONS): the typer command below is built from it, and
areal_cli.cli reads it to run the plain forms (known flags, well-formed values) without
importing typer; anything else (help, an unknown flag, a bad value) goes through typer for
its messages. Nothing here imports typer, rich or typing before the first dump.

No `from __future__ import annotations`: `register` builds the typer command with its
annotations evaluated where it runs, where pathlib is imported (not before the first dump).
"""

import time

from areal_cli.commands import Opt
from areal_cli.diagnose import hang, targets
from areal_cli.errors import UsageError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from pathlib import Path


def _path(value: str) -> "Path":
    from pathlib import Path  # only with --out: pathlib is no import before the first dump

    return Path(value)


OPTIONS = [
    Opt("pid", "--pid", "-p", kind=int, many=True,
        help="A rank, or a launcher (torchrun, areal) whose workers to dump. Repeatable."),
    Opt("job", "--job", "-j", help="A job record EXPERIMENT/TRIAL (see `areal ps`)."),
    Opt("samples", "--samples", "-n", kind=int, default=3, lo=1, hi=100,
        help="Dump rounds compared for movement."),
    Opt("interval", "--interval", kind=float, default=0.5, lo=0.0,
        help="Seconds from one round's start to the next."),
    Opt("native", "--native", kind=bool, default=False, help="Include C/C++ frames (slower)."),
    Opt("show_locals", "--locals", kind=bool, default=False,
        help="Include local variables of each frame."),
    Opt("timeout", "--timeout", kind=float, default=10.0, lo=0.5,
        help="Seconds py-spy may take per process."),
    Opt("json_out", "--json", kind=bool, default=False, help="Print the report as JSON."),
    Opt("out_dir", "--out", kind=_path, help="Write raw per-rank dumps and summary.json here."),
    Opt("home", "--home", help="AREAL_HOME holding job records (for --job)."),
    # Its typer option is the one every command shares (commands/_common.RegistryOpt).
    Opt("registry", "--registry"),
]  # fmt: skip
_BY_KEY = {opt.key: opt for opt in OPTIONS}


def plain(**opts) -> int:
    """The command from the options the fast path read."""
    return run(**opts)


def run(
    pid: list[int],
    job: str | None,
    samples: int,
    interval: float,
    native: bool,
    show_locals: bool,
    timeout: float,
    json_out: bool,
    out_dir: "Path | None",
    home: str | None,
    registry: str | None = None,
) -> int:
    """Dump, judge and print; the exit code (1 when a dump failed; a hang found is 0)."""
    if registry:
        from areal_cli import settings

        settings.use_registry(registry)
    found_at = time.monotonic()
    jobs = _targets(pid, job, home)
    find_s = time.monotonic() - found_at
    reports = _dump(
        jobs,
        json_out,
        samples=samples,
        interval=interval,
        native=native,
        show_locals=show_locals,
        timeout=timeout,
        torch_analyzer=bool(out_dir),  # seconds of torch's import: for the bundle only
    )
    from areal_cli import console, settings
    from areal_cli.diagnose import hang_judge  # loaded already: the dumps' judge

    hang_judge.note_refused(reports, settings.registry_url())
    written = hang_judge.write_bundle(reports, out_dir) if out_dir else []
    if json_out:
        data = hang_judge.to_json(reports)
        data["timing"]["find_s"] = round(find_s, 4)
        if out_dir:
            data["out"] = str(out_dir)
        console.print_json(data)
    else:
        for i, rep in enumerate(reports):
            if i:
                console.out.print()
            print_report(console.out, rep, show_locals)
        if written:
            console.out.print(f"[dim]raw dumps and summary.json written to {out_dir}[/]")
    if any(rep.failed for rep in reports):
        _print_errors(console.err, reports)
        return _leaving(1)
    return _leaving(0)


def _targets(pid: list[int], job: str | None, home: str | None) -> list[targets.Job]:
    if pid and job:
        raise UsageError("give --pid or --job, not both")
    if job or home is not None:
        # Job records and their schedulers: imported for --job (or --home) only.
        from areal_cli.schedulers import doctor_targets

        return doctor_targets.resolve(pids=list(pid or []), job=job, home=home)
    return targets.resolve(pids=list(pid or []))


def _dump(jobs: list[targets.Job], json_out: bool, samples: int, **options) -> list:
    """Every job's reports, with a spinner on a terminal."""
    status = None
    if not json_out:  # else console (and typing with it) once the dumps are done
        from areal_cli import console

        if console.err.is_terminal:
            status = console.err.status(f"dumping {sum(len(j.ranks) for j in jobs)} rank(s)...")
            status.start()

    def progress(sample: int, done: int, total: int) -> None:
        if status is not None:
            label = f" (sample {sample + 1}/{samples})" if samples > 1 else ""
            status.update(f"dumping {done}/{total} rank(s){label}...")

    try:
        return hang.diagnose(jobs, samples=samples, on_progress=progress, **options)
    finally:
        if status is not None:
            status.stop()


def print_report(out, rep, show_locals: bool = False) -> None:
    """One job's report on the console `out` (also `doctor allreduce`'s, when its repro hangs)."""
    from areal_cli.diagnose import hang_report

    lines, tree = hang_report.render(rep, show_locals)
    for line in lines:
        out.print(line)
    # Wrap long frames instead of cutting them: the file:line at the end is the point.
    out.print(tree, soft_wrap=False)


def _print_errors(err, reports: list) -> None:
    for rep in reports:
        for e in rep.errors:
            who = (
                f"node {e['node']}"
                if e.get("rank") is None and e.get("node")
                else (f"rank {e['rank']} (pid {e['pid']})")
            )
            err.print(f"[red]{who}: {e['error']}[/]")
            if e.get("fix"):
                err.print(f"[yellow]fix:[/] {e['fix']}")


def _leaving(code: int) -> int:
    """`code`, once the collector no longer looks at what is alive now: the process ends next,
    and its last collection walked every module, dump and report (16 ranks: 10.6-14.4 ms from
    the last atexit hook to the exit, 4.0-4.7 ms without that walk)."""
    import gc

    gc.freeze()
    return code


HELP = """Dump every rank's Python stack at once, group identical stacks, name the odd rank.

Without --pid or --job: every torchrun/areal job of this user on this host.

Verdicts, in the order they are tried: {kinds}. Each carries advice (restart, stop or
unknown, and why). A hang is called only when nothing moved across the samples (3 over
about 1 s).

--json prints {job, ranks, groups, verdict, samples, errors, timing}; with several
jobs, the first that hangs is at the top level and all are under "jobs".

Exit code: 0 a verdict was reached, a hang found included (the verdict says which; with
--json, its "verdict" field) · 1 a rank could not be dumped · 2 bad target or usage.

\b
Examples:
  areal doctor hang --job myexp/trial0
  areal doctor hang --pid 12345      # torchrun's pid: its workers are found
  areal doctor hang --samples 5 --interval 1 --json
  areal doctor hang --job myexp/trial0 --native --out ./hang-report
"""


def register(app) -> None:
    """The typer command, its options built from OPTIONS (typer is imported here only)."""
    from pathlib import Path

    import typer

    from areal_cli.commands._common import RegistryOpt
    from areal_cli.diagnose import hang_rules

    o = _BY_KEY
    # The kinds are read from the verdict table itself, so a new row shows here without an
    # edit (hang_rules imports nothing: the help does not pay for the judging code).
    help_text = HELP.replace("{kinds}", hang_rules.help_text())

    @app.command("hang", help=help_text)
    def hang_cmd(
        pid: list[int] = o["pid"].option(),
        job: str = o["job"].option(),
        samples: int = o["samples"].option(),
        interval: float = o["interval"].option(),
        native: bool = o["native"].option(),
        show_locals: bool = o["show_locals"].option(),
        timeout: float = o["timeout"].option(),
        json_out: bool = o["json_out"].option(),
        out_dir: Path = o["out_dir"].option(),
        home: str = o["home"].option(),
        registry: str = RegistryOpt,
    ) -> None:
        rc = run(
            pid=list(pid or []),
            job=job,
            samples=samples,
            interval=interval,
            native=native,
            show_locals=show_locals,
            timeout=timeout,
            json_out=json_out,
            out_dir=out_dir,
            home=home,
            registry=registry,
        )
        if rc:
            raise typer.Exit(rc)
