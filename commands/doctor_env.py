"""`areal doctor env`: debug environment presets, printed for a shell or run around a command."""

from __future__ import annotations

import typer
from rich.markup import escape
from rich.table import Table

from areal_cli import console
from areal_cli.diagnose import presets
from areal_cli.errors import UsageError


def register(app: typer.Typer) -> None:
    app.command("env", context_settings={"allow_interspersed_args": False})(env_cmd)


def env_cmd(
    cmd: list[str] = typer.Argument(
        None, help="Command to run under the preset (after --).", show_default=False
    ),
    preset: str = typer.Option(
        None, "--preset", "-P", help="hang | nccl | nccl-bisect | crash | compile | perf"
    ),
    shell: str = typer.Option(
        "bash", "--shell", help="Output format: bash | fish | json | dotenv."
    ),
    list_: bool = typer.Option(False, "--list", "-l", help="List the presets."),
    explain: bool = typer.Option(False, "--explain", help="Show each variable with its meaning."),
) -> None:
    """Debug environment presets: print them for your shell, or run a command under one.

    Warnings about combinations that do nothing or harm (dump-on-timeout without a buffer,
    transport switches left on, CUDA_LAUNCH_BLOCKING in a perf run) go to stderr, including
    ones caused by variables already in your environment.

    \b
    Examples:
      eval "$(areal doctor env --preset hang)"
      areal doctor env --preset nccl --shell fish | source
      areal doctor env --preset nccl -- areal train --alloc fsdp:d2 train.py
      areal doctor env --preset nccl-bisect --explain
      areal doctor env --list
    """
    if shell not in presets.SHELLS:
        raise UsageError(
            f"unknown --shell {shell!r}", hint="choose one of: " + ", ".join(presets.SHELLS)
        )
    if list_:
        _list_presets(shell)
        return
    if not preset:
        raise UsageError(
            "--preset is required",
            hint="valid presets: " + ", ".join(presets.preset_names()) + " (see --list)",
        )
    p = presets.get_preset(preset)
    warnings = presets.check(preset)
    for w in warnings:
        origin = " (from your environment)" if w.source == "environment" else ""
        console.err.print(f"[yellow]warning:[/] {w.message}{origin}")
        console.err.print(f"  [dim]fix: {w.fix}[/]")
    if cmd:
        code = presets.run_with_preset(preset, list(cmd))
        raise typer.Exit(code)
    if explain:
        _explain(p, shell)
        return
    # Raw text: this is meant for eval, no rich markup or wrapping.
    typer.echo(presets.render(preset, shell), nl=False)


def _list_presets(shell: str) -> None:
    items = [presets.get_preset(n) for n in presets.preset_names()]
    if shell == "json":
        console.print_json(
            [{"name": p.name, "description": p.description, "vars": p.env()} for p in items]
        )
        return
    # Two columns, the variables under the description: a third column squeezed the text to
    # a word per line at 80 columns (and in a pipe, which rich lays out 80 wide).
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    table.add_column("preset", style="bold cyan", no_wrap=True)
    table.add_column("what it is for · variables")
    for p in items:
        names = " ".join(v.name for v in p.vars)
        table.add_row(p.name, f"{p.description}\n[dim]{names}[/]")
    console.out.print(table)


def _explain(p, shell: str) -> None:
    if shell == "json":
        console.print_json(
            {
                "name": p.name,
                "description": p.description,
                "vars": [{"name": v.name, "value": v.value, "meaning": v.meaning} for v in p.vars],
            }
        )
        return
    console.out.print(f"[bold]{p.name}[/]: {p.description}")
    wide = max(len(v.name) for v in p.vars) + max(len(v.value) for v in p.vars) + 4
    if console.out.width - wide < MEANING_MIN:
        # Too narrow for three columns (80 wide, a pipe): each variable, its meaning under it.
        for v in p.vars:
            console.out.print(f"[cyan]{v.name}[/]=[bold]{escape(v.value)}[/]")
            console.out.print(f"    {escape(v.meaning)}")
        return
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    table.add_column("variable", style="cyan", no_wrap=True)
    table.add_column("value", style="bold", no_wrap=True)
    table.add_column("meaning")
    for v in p.vars:
        table.add_row(v.name, v.value, v.meaning)
    console.out.print(table)


MEANING_MIN = 40  # a meaning column narrower than this reads a word or two per line
