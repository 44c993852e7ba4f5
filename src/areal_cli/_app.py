"""The typer app behind `areal`: commands load on demand, help drawn by console.render_help.

Split from areal_cli.cli so that a call which needs no parser (`areal doctor hang` with plain
flags, see commands/doctor_hang.py) starts without importing typer. A group's commands come
from a table (areal_cli.commands.COMMANDS, a group module's own COMMANDS): each module is
imported when one of its commands runs or shows its help, and a group's help lists the
table's one-liners without importing any.
"""

from __future__ import annotations

import copy
import importlib
import math
import os
from collections.abc import Callable, Iterator, Mapping
from functools import partial

import typer
from typer.core import TyperCommand, TyperGroup

from areal_cli import __version__, console
from areal_cli.commands import COMMANDS, HELP


class _Help:
    """Help drawn by console.render_help: paragraphs re-wrap, `\\b` blocks stay as written."""

    def format_help(self, ctx, formatter) -> None:
        formatter.write(console.render_help(ctx, self.help_commands(ctx)) + "\n")

    def collect_usage_pieces(self, ctx) -> list[str]:
        return console.usage_pieces(ctx)

    def help_commands(self, ctx) -> list[tuple[str, str]]:
        return []


class ArealCommand(_Help, TyperCommand):
    pass


class _LazyCommands(Mapping):
    """Commands by name, each built on first lookup: `areal ps` builds one, `--help` none."""

    def __init__(self, builders: dict[str, Callable]) -> None:
        self._builders = builders
        self._built: dict = {}

    def __getitem__(self, name: str):
        if name not in self._built:
            self._built[name] = self._builders[name]()
        return self._built[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._builders)

    def __len__(self) -> int:
        return len(self._builders)


class ArealGroup(_Help, TyperGroup):
    """A group whose commands are built on first lookup from `table` (name: (module in
    areal_cli.commands, the one line its help shows)); `--help` builds none."""

    table: dict[str, tuple[str, str]] = {}

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.commands = _LazyCommands(
            {name: partial(_load, name, self.table) for name in self.table}
        )

    def list_commands(self, ctx) -> list[str]:
        return list(self.commands)  # typer's goes through items(), building every command

    def help_commands(self, ctx) -> list[tuple[str, str]]:
        return [(name, line) for name, (_, line) in self.table.items()]


class RootGroup(ArealGroup):
    table = COMMANDS


def _load(name: str, table: dict[str, tuple[str, str]] = COMMANDS):
    """The click command for `name`, built from its module's typer definitions."""
    module = importlib.import_module(f"areal_cli.commands.{table[name][0]}")
    if hasattr(module, "COMMANDS"):  # a group of sub-commands (doctor), each loaded on demand
        return _group(name, module)
    sub = typer.Typer()
    module.register(sub)
    # A module may register several commands (ps, logs, stop): build the one asked for.
    return _command(next(info for info in sub.registered_commands if info.name == name))


def _group(name: str, module):
    """The group `module.app` describes, its commands those of `module.COMMANDS`."""
    shell = typer.Typer(rich_markup_mode=None)
    shell.info, shell.registered_callback = module.app.info, module.app.registered_callback
    shell.info.cls = type(f"{name.title()}Group", (ArealGroup,), {"table": module.COMMANDS})
    group = typer.main.get_group(shell)
    group.name = name
    return group


def _command(info):
    if info.cls in (None, TyperCommand):
        info.cls = ArealCommand
    command = typer.main.get_command_from_info(
        info, pretty_exceptions_short=True, rich_markup_mode=None
    )
    for param in command.params:
        _guard(param)
    return command


class _Finite:
    """A float option's type that also refuses nan and inf: both pass a range check (every
    comparison with nan is false), and a nan duration or timeout never ends."""

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if isinstance(rv, float) and not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return rv


class _NotEmpty:
    """A path option's type that refuses the empty string, which pathlib reads as the
    current folder: `-o ''` would write there, `--home ''` read records from there."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip():
            self.fail("an empty path names no file or folder.", param, ctx)
        return super().convert(value, param, ctx)


_GUARDED: dict[type, type] = {}


def _guard(param) -> None:
    """Give every float and path parameter of every command the checks above."""
    kind = type(param.type)
    # By the type's name, as the help pages read it: typer's click types are its own copy.
    name = str(getattr(param.type, "name", "")).split()[:1]
    if isinstance(param.type, (_Finite, _NotEmpty)):
        return
    if name == ["float"]:
        mixin = _Finite
    elif name in (["path"], ["file"], ["directory"]):
        mixin = _NotEmpty
    else:
        return
    if kind not in _GUARDED:
        _GUARDED[kind] = type(f"{mixin.__name__.strip('_')}{kind.__name__}", (mixin, kind), {})
    guarded = copy.copy(param.type)  # typer's FLOAT is one object shared by every option
    guarded.__class__ = _GUARDED[kind]
    param.type = guarded


app = typer.Typer(
    name="areal",
    cls=RootGroup,
    help=HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"areal {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors."),
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
) -> None:
    if debug:
        os.environ["AREAL_DEBUG"] = "1"
