"""`areal doctor profile`: record every rank with py-spy at once; name the straggler."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from areal_cli import console
from areal_cli.diagnose import profile
from areal_cli.errors import EXIT_FAILED

from .doctor_jobs import find_jobs, live_job_command, print_json


def register(app: typer.Typer) -> None:
    app.command("profile")(profile_cmd)


@live_job_command
def profile_cmd(
    duration: float = typer.Option(
        10.0, "--duration", "-d", min=0.5, max=3600, help="Seconds to record."
    ),
    out_dir: Path = typer.Option(
        ..., "--out", "-o", help="Folder for the flame graphs, speedscope files and summary."
    ),
    rate: int = typer.Option(100, "--rate", min=1, max=1000, help="Samples per second."),
    native: bool = typer.Option(False, "--native", help="Include C/C++ frames (py-spy --native)."),
    servers: bool = typer.Option(
        True, "--servers/--no-servers", help="Record the job's inference servers here too."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    **target,
) -> None:
    """Record every rank with py-spy at once; name the rank the others wait for.

    Writes per rank: rankN.svg (flame graph of the main thread) and
    rankN.speedscope.json (open in speedscope.app), serverN.* for the job's
    inference servers on this host, and summary.json. The summary
    gives each rank's top functions, its share of time inside collectives, and the
    mean time it computes between two collectives; the rank that computes clearly
    longest while the others wait in collectives is named the straggler.

    Exit code: 0 recorded · 1 a process could not be recorded · 2 bad target.

    \b
    Examples:
      areal doctor profile --job myexp/trial0 --duration 10 --out ./prof
      areal doctor profile --pid 12345 -d 5 -o ./prof --json
      areal doctor profile --job myexp/trial0 -d 5 -o ./prof --native
    """
    jobs = find_jobs(target)
    progress = None
    if not json_out and console.err.is_terminal:
        progress = Progress(
            TextColumn("recording {task.fields[n]} process(es)"),
            BarColumn(),
            TimeElapsedColumn(),
            console=console.err,
            transient=True,
        )
        progress.start()
    reports = []
    try:
        for i, j in enumerate(jobs):
            task = None
            if progress is not None:
                task = progress.add_task("rec", total=duration, n=len(j.ranks))

            def tick(elapsed: float, task=task) -> None:
                if progress is not None:
                    progress.update(task, completed=elapsed)

            where = out_dir / f"job{i}" if len(jobs) > 1 else out_dir
            reports.append(
                profile.record(
                    j,
                    where,
                    duration=duration,
                    rate=rate,
                    native=native,
                    on_progress=tick,
                    servers=profile.job_servers(j) if servers else [],
                )  # fmt: skip
            )
    finally:
        if progress is not None:
            progress.stop()
    if json_out:
        print_json(reports)
    else:
        for i, rep in enumerate(reports):
            _render_profile(rep, out_dir if len(jobs) == 1 else out_dir / f"job{i}")
    if any(r.error for rep in reports for r in rep.ranks):
        raise typer.Exit(EXIT_FAILED)


def _render_profile(rep, where: Path) -> None:
    out = console.out
    t = Table(title=f"profile of {escape(rep.job)}, {rep.duration:g}s at {rep.rate}/s",
              title_justify="left")  # fmt: skip
    on_nodes = any(r.node for r in rep.ranks)
    cols = ("rank", "pid") + (("node",) if on_nodes else ())
    for col in cols + ("samples", "in collectives", "compute between", "top function"):
        t.add_column(col, justify="left" if col == "top function" else "right")
    for r in rep.ranks:
        node = [escape(r.node or "-")] if on_nodes else []
        if r.error:
            t.add_row(str(r.rank), str(r.pid), *node, "-", "-", "-", f"[red]{escape(r.error)}[/]")
            continue
        top = r.top_self[0] if r.top_self else None
        t.add_row(
            f"{r.rank}" if r.role == "rank" else f"server {r.rank}",
            str(r.pid),
            *node,
            str(r.samples),
            f"{r.collective_share:.0%}",
            f"{r.compute_between_s:.3f}s",
            escape(f"{top['function'].split(' (')[0]} {top['share']:.0%}") if top else "",
        )
    out.print(t)
    if rep.straggler:
        out.print(f"[bold red]straggler: {escape(rep.straggler['summary'])}[/]")
    else:
        out.print("no straggler: the ranks compute about as long between collectives")
    names = "rankN-NODE.svg" if on_nodes else "rankN.svg"
    out.print(f"[dim]flame graphs ({names}), speedscope files and summary.json in {where}[/]")
