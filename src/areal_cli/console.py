"""Rendering for the CLI: one rich console per stream, errors in red with a hint, exit codes.

Only `commands/` and `cli.py` use this module; the library returns data or raises.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

from areal_cli.errors import ArealError

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def print_json(data: Any) -> None:
    """Machine output: plain JSON on stdout, nothing else on stdout."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()


def report_error(e: ArealError) -> None:
    err.print(f"[bold red]error:[/] {_escape(e.message)}")
    if e.detail:
        err.print(_escape(e.detail), style="dim")
    if e.hint:
        err.print(f"[yellow]hint:[/] {_escape(e.hint)}")


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)
