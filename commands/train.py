"""`areal train` (being built)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command("train")
    def _cmd() -> None:
        """Not built yet."""
        raise typer.Exit(2)
