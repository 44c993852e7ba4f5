"""`areal doctor` (being built)."""

from __future__ import annotations

import typer

app = typer.Typer(
    help="Diagnose distributed training: hangs, env presets, all_reduce, environment, mesh.",
    no_args_is_help=True,
)


@app.command("check")
def check() -> None:
    """Not built yet."""
    raise typer.Exit(2)
