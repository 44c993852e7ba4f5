"""`areal doctor check`: is this host ready to run and debug jobs? One row per fact, with the fix."""

from __future__ import annotations

import typer
from rich.markup import escape
from rich.table import Table

from areal_cli import console, schedulers
from areal_cli.diagnose import check
from areal_cli.schedulers import doctor_targets

from ._common import RegistryOpt


def register(app: typer.Typer) -> None:
    app.command("check")(check_cmd)


def check_cmd(
    json_out: bool = typer.Option(False, "--json", help="Print the rows as JSON."),
    home: str = typer.Option(None, "--home", help="AREAL_HOME holding job records."),
    registry: str = RegistryOpt,
    scheduler: str = typer.Option(
        None,
        "--scheduler",
        help="Also the scheduler's own rows: slurm (version, partitions, shared files), ray "
        "(client and cluster, nodes, shared files).",
    ),
    python: str = typer.Option(
        None,
        "--python",
        help="The trainer's interpreter: AReaL's version there, the sglang metadata its "
        "trainer needs, and served SGLang versions against AReaL's pin.",
    ),
) -> None:
    """Is this host ready to run and debug jobs? One row per fact, with the fix.

    Python, torch, CUDA, NCCL, GPUs, sglang/vllm/transformers, py-spy attach, /dev/shm, open
    files, the registry, registered servers, processes left from earlier jobs. Each row passes, warns or fails with the fix to apply; exit code 1 when any row fails.
    With --scheduler slurm: Slurm's version, each partition's GPUs per node, and whether the
    nodes see the registry and log folders.

    \b
    Examples:
      areal doctor check
      areal doctor check --scheduler slurm
      areal doctor check --python ~/areal-venv/bin/python   # AReaL's trainer venv
      areal doctor check --json | jq '.rows[] | select(.status != "pass")'
    """
    scheduler = schedulers.pick(scheduler) if scheduler else None
    inputs = doctor_targets.check_inputs(scheduler, home, registry)
    if not json_out and console.err.is_terminal:
        with console.err.status("checking this host..."):
            rows = check.run_checks(home=home, registry=registry, python=python, **inputs)
    else:
        rows = check.run_checks(home=home, registry=registry, python=python, **inputs)
    failed = [r for r in rows if r.status == check.FAIL]
    if json_out:
        console.print_json(
            {
                "rows": [r.to_json() for r in rows],
                "ok": not failed,
                "counts": {
                    s: sum(r.status == s for r in rows)
                    for s in (check.PASS, check.WARN, check.FAIL)
                },
            }
        )
    else:
        t = Table(box=None, header_style="bold", pad_edge=False)
        t.add_column("", no_wrap=True)
        t.add_column("check", style="bold", no_wrap=True)
        t.add_column("result", overflow="fold")
        t.add_column("fix", style="yellow", overflow="fold")
        mark = {
            check.PASS: "[green]✓ pass[/]",
            check.WARN: "[yellow]! warn[/]",
            check.FAIL: "[red]✗ fail[/]",
        }
        for r in rows:
            t.add_row(mark[r.status], r.name, escape(r.detail), escape(r.fix or ""))
        console.out.print(t)
    if failed:
        raise typer.Exit(1)
