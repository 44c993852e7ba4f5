"""`areal doctor allreduce`: the minimal all_reduce repro under torchrun, its table of sizes."""

from __future__ import annotations

import os

import typer
from rich.live import Live
from rich.table import Table

from areal_cli import console
from areal_cli.commands.doctor_hang import print_report
from areal_cli.diagnose import allreduce, hang_judge


def register(app: typer.Typer) -> None:
    app.command("allreduce")(allreduce_cmd)


def allreduce_cmd(
    nproc: int = typer.Option(
        None, "--nproc", min=1, help="Ranks (default: GPUs here, or 2 on CPU)."
    ),
    backend: str = typer.Option(
        None, "--backend", help="nccl | gloo (default: nccl with GPUs, else gloo)."
    ),
    sizes: str = typer.Option(
        None, "--sizes", help="MIN:MAX bytes, doubling (default 1K:256M nccl, 1K:16M gloo)."
    ),
    iters: int = typer.Option(20, "--iters", min=1, help="Timed all_reduce calls per size."),
    warmup: int = typer.Option(5, "--warmup", min=0, help="Untimed calls per size first."),
    timeout: float = typer.Option(
        120.0, "--timeout", min=1.0, help="Seconds before the run counts as hung."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the results as JSON."),
    print_script: bool = typer.Option(
        False, "--print-script", help="Print the standalone repro script and exit."
    ),
) -> None:
    """Minimal all_reduce repro under torchrun: time, algbw, busbw and a correctness check per size.

    busbw = algbw · 2(n−1)/n, as nccl-tests reports it. When the run exceeds --timeout, the
    hang doctor dumps the repro's ranks, prints its verdict, and the repro is torn down.

    \b
    Examples:
      areal doctor allreduce --nproc 8
      areal doctor allreduce --backend gloo --nproc 2 --sizes 1K:16M
      areal doctor env --preset nccl -- areal doctor allreduce --nproc 8
      areal doctor allreduce --print-script > repro.py   # for a bug report
    """
    if print_script:
        typer.echo(allreduce.script_text(), nl=False)
        return
    backend = backend or allreduce.default_backend()
    nproc = nproc or allreduce.default_nproc(backend)
    sizes = sizes or allreduce.DEFAULT_SIZES.get(backend, "1K:16M")
    if not json_out:
        console.out.print(
            f"[bold]all_reduce[/] · backend {backend} · {nproc} ranks · sizes {sizes} · "
            f"iters {iters} · warmup {warmup} · timeout {timeout:g}s"
        )
    result = _run(json_out, nproc=nproc, backend=backend, sizes=sizes, iters=iters,
                  warmup=warmup, timeout=timeout)  # fmt: skip
    if json_out:
        console.print_json(result.to_json())
    else:
        _print_outcome(result)
    _exit_on_failure(result, timeout)


def _run(json_out: bool, timeout: float, **options):
    """The repro's result, its rows drawn live on a terminal (a table at the end elsewhere)."""
    table = None if json_out else _allreduce_table()
    live = None
    if table is not None and console.out.is_terminal:
        live = Live(table, console=console.out, refresh_per_second=8)
        live.start()

    def on_row(row) -> None:
        if table is not None:
            _add_row(table, row)

    def on_hang() -> None:
        if live is not None:
            live.stop()
        console.err.print(f"[red]no progress within {timeout:g}s: dumping the repro's ranks[/]")

    force_hang = os.environ.get(allreduce.FORCE_HANG_ENV) == "1"
    try:
        result = allreduce.run(timeout=timeout, force_hang=force_hang, on_row=on_row,
                               on_hang=on_hang, **options)  # fmt: skip
    finally:
        if live is not None and live.is_started:
            live.stop()
    if live is None and table is not None:
        console.out.print(table)
    return result


def _print_outcome(result) -> None:
    if result.rows:
        console.out.print(f"[bold]avg busbw[/] {result.avg_busbw:.3f} GB/s · #wrong {result.wrong}")
    if result.timed_out:
        if result.hang_reports:
            print_report(console.out, hang_judge.primary(result.hang_reports))
        elif result.hang_error:
            console.err.print(f"[red]hang diagnosis failed:[/] {result.hang_error}")


def _exit_on_failure(result, timeout: float) -> None:
    if result.timed_out:
        console.err.print(
            f"[bold red]error:[/] the all_reduce repro did not finish within {timeout:g}s; "
            "it was torn down"
        )
        raise typer.Exit(3)
    if result.wrong:
        console.err.print(
            f"[bold red]error:[/] {result.wrong} wrong element(s): the all_reduce result is corrupt"
        )
        raise typer.Exit(1)


def _allreduce_table():
    t = Table(box=None, header_style="bold", pad_edge=False)
    # Two-line headers as nccl-tests prints them: the table fits 80 columns.
    for name, just in (
        ("size\n(B)", "right"),
        ("count\n(elements)", "right"),
        ("type", "right"),
        ("redop", "right"),
        ("time\n(us)", "right"),
        ("algbw\n(GB/s)", "right"),
        ("busbw\n(GB/s)", "right"),
        ("#wrong", "right"),
    ):
        t.add_column(name, justify=just, no_wrap=True)
    return t


def _add_row(t, row) -> None:
    wrong = f"[bold red]{row.wrong}[/]" if row.wrong else "0"
    t.add_row(
        str(row.size),
        str(row.count),
        row.type,
        row.redop,
        f"{row.time_us:.1f}",
        f"{row.algbw_gbps:.3f}",
        f"{row.busbw_gbps:.3f}",
        wrong,
    )
