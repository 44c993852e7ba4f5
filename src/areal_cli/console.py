"""Rendering for the CLI: one rich console per stream, errors in red with a hint, help pages.

Only `commands/` and `cli.py` use this module; the library returns data or raises. The
consoles are made on first use: `--json` output never pays for importing rich.
"""

from __future__ import annotations

import json
import os
import sys

from areal_cli.errors import ArealError

# typing's TYPE_CHECKING without importing typing (5 ms of `areal ps --json`): type checkers
# take the name as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_consoles: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    """`console.out` / `console.err`: rich consoles for stdout and stderr."""
    if name not in ("out", "err"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _consoles:
        from rich.console import Console

        _consoles[name] = Console(stderr=name == "err", highlight=False, soft_wrap=True)
    return _consoles[name]


def print_json(data: Any) -> None:
    """Machine output: plain JSON on stdout, nothing else on stdout."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()


def report_error(e: ArealError) -> None:
    err = __getattr__("err")
    err.print(f"[bold red]error:[/] {_escape(e.message)}")
    if e.detail:
        err.print(_escape(e.detail), style="dim")
    if e.hint:
        err.print(f"[yellow]hint:[/] {_escape(e.hint)}")


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


# --------------------------------------------------------------------------- help pages

# Short type names keep the option column narrow ("int range" -> INT: the help says the range).
_METAVARS = {"str": "TEXT", "text": "TEXT", "int": "INT", "integer": "INT", "float": "NUM"}


def render_help(ctx, commands: list[tuple[str, str]]) -> str:
    """The help page of `ctx.command` as text that fits the terminal.

    Help texts are rich markup. Paragraphs (blank-line separated) re-wrap to the width; a
    paragraph whose first line is `\\b`, or whose lines are all indented, is printed line
    for line (examples), never wrapped mid-line.
    """
    import io
    import shutil

    from rich.console import Console
    from rich.padding import Padding
    from rich.table import Table
    from rich.text import Text

    cmd = ctx.command
    width = shutil.get_terminal_size((80, 24)).columns
    color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
    buf = io.StringIO()
    con = Console(file=buf, width=width, force_terminal=color, no_color=not color, highlight=False)

    usage = " ".join([ctx.command_path, *usage_pieces(ctx)])
    con.print(Text.assemble(("Usage: ", "yellow"), (usage, "bold")))
    for block in _blocks(cmd.help or ""):
        con.print()
        con.print(block)

    def section(title: str, rows: list[tuple[Text, Text]]) -> None:
        """Names and help in two columns; the names take at most a third of the width."""
        if not rows:
            return
        cap = width // 3 - 4  # less the indent and the gap
        names = max((left.cell_len for left, _ in rows if left.cell_len <= cap), default=cap)

        def grid() -> Table:
            g = Table.grid(padding=(0, 2))
            g.add_column(width=names, no_wrap=True)
            g.add_column()
            return g

        con.print()
        con.print(Text(title, style="bold"))
        part = grid()
        for left, right in rows:
            if left.cell_len <= names:
                part.add_row(left, right)
                continue
            # A longer name gets a line of its own, its help below in the help column.
            if part.row_count:
                con.print(Padding(part, (0, 0, 0, 2)))
            con.print(Padding(left, (0, 0, 0, 2)))
            part = grid()
            part.add_row(Text(), right)
        con.print(Padding(part, (0, 0, 0, 2)))

    args, opts = [], []
    for p in cmd.get_params(ctx):
        if getattr(p, "hidden", False):
            continue
        if p.param_type_name == "argument":
            name = argument_metavar(p)
            args.append((Text(name, style="bold cyan"), _markup(getattr(p, "help", None) or "")))
        else:
            opts.append(_option_row(p))
    section("Arguments", args)
    section("Options", opts)
    section("Commands", [(Text(n, style="bold cyan"), _markup(h)) for n, h in commands])
    # Table cells pad to the full width: trailing blanks would only confuse a pager.
    return "\n".join(line.rstrip() for line in buf.getvalue().rstrip("\n").split("\n"))


def usage_pieces(ctx) -> list[str]:
    """`[OPTIONS] SCRIPT [ARGS]...`: arguments by name, optional ones in brackets."""
    cmd = ctx.command
    pieces = [cmd.options_metavar] if cmd.options_metavar else []
    for p in cmd.get_params(ctx):
        if p.param_type_name == "argument":
            name = argument_metavar(p)
            pieces.append(name if p.required else f"[{name}]")
    subcommands = getattr(cmd, "subcommand_metavar", None)
    if subcommands:
        pieces.append(subcommands)
    elif ctx.allow_extra_args:
        pieces.append("[ARGS]...")
    return pieces


def argument_metavar(p) -> str:
    return (p.metavar or (p.name or "").upper()) + ("..." if p.nargs == -1 else "")


def _blocks(help_text: str) -> list:
    import inspect

    blocks = []
    for para in inspect.cleandoc(help_text).split("\n\n"):
        lines = para.split("\n")
        if lines[0].strip() == "\b":
            lines = lines[1:]
        elif not all(line.startswith((" ", "\t")) for line in lines):
            blocks.append(_markup(" ".join(line.strip() for line in lines)))
            continue
        text = _markup("\n".join(lines))
        text.no_wrap, text.overflow = True, "fold"
        blocks.append(text)
    return blocks


def _markup(text: str):
    from rich.text import Text

    return Text.from_markup(text, emoji=False)


def _option_row(p) -> tuple:
    from rich.text import Text

    names = sorted(p.opts, key=len)  # -a before --alloc
    secondary = list(p.secondary_opts)
    if len(names) == 1 and secondary == ["--no-" + names[0][2:]]:
        names, secondary = ["--[no-]" + names[0][2:]], []
    left = Text(", ".join(names + secondary), style="bold cyan")
    if not (p.is_flag or p.count):
        kind = p.type.name.split()[0]
        meta = p.metavar or _METAVARS.get(kind, kind.upper())
        left.append(f" {meta}", style="yellow")
    right = _markup(p.help or "")
    default = p.default
    shown = p.show_default is not False and not p.is_flag
    if shown and default not in (None, (), []) and "default" not in right.plain:
        value = f"{default:g}" if isinstance(default, float) else str(default)
        right.append(f" (default {value})", style="dim")
    if p.required:
        right.append(" (required)", style="red")
    return left, right
