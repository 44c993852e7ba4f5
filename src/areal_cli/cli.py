"""The `areal` entry point: a Typer app whose commands load on demand; errors become exit codes.

Start-up is paid on every call, so only typer is imported here. A command's module is
imported when that command runs or shows its help; `areal --help` lists the commands from
the table below without importing any of them. Help is drawn by `console.render_help`
(typer's own renderer imports rich.markdown and pygments).
"""

from __future__ import annotations

import errno
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from functools import partial

import typer
from typer.core import TyperCommand, TyperGroup

from areal_cli import __version__
from areal_cli.errors import EXIT_INTERRUPTED, ArealError

# name: (module in areal_cli.commands, the one line `areal --help` shows). A test checks
# each line against the first line of the command's own help.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("serve", "Start SGLang, vLLM or hf inference servers, wait until healthy, register them."),
    "train": ("train", "Run training workers with torchrun against inference servers."),
    "ps": ("jobs", "List jobs: state, processes, servers and whether each answers /health."),
    "logs": ("jobs", "Show a job's logs, merged with a \\[server-N] / \\[rank-N] prefix."),
    "stop": ("jobs", "Stop a trial's jobs, every process they started and their registry entries."),
    "key": ("key", "Print the API key of servers you started as E/T, for a client of your own."),
    "alloc": ("alloc", "Explain an allocation string: its components, parallel dims and GPU count."),
    "init-model": ("init_model", "Write a tiny Qwen2-style causal LM (random weights, byte-level tokenizer) to DIR."),
    "doctor": ("doctor", "Diagnose distributed training: hangs, debug env presets, all_reduce, host health, mesh."),
}  # fmt: skip

HELP = """Launch and diagnose RL post-training jobs for LLMs.

\b
Examples:
  areal serve --backend hf --model ./tiny --detach
  areal train --alloc fsdp:d2 train.py --config tiny_cpu.yaml
  areal ps
  areal logs E/T -f
  areal stop E/T
  areal doctor hang --job E/T
"""


class _Help:
    """Help drawn by console.render_help: paragraphs re-wrap, `\\b` blocks stay as written."""

    def format_help(self, ctx, formatter) -> None:
        from areal_cli import console

        formatter.write(console.render_help(ctx, self.help_commands(ctx)) + "\n")

    def collect_usage_pieces(self, ctx) -> list[str]:
        from areal_cli import console

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
    def list_commands(self, ctx) -> list[str]:
        return list(self.commands)  # typer's goes through items(), building every command

    def help_commands(self, ctx) -> list[tuple[str, str]]:
        return [(n, first_line(self.get_command(ctx, n).help)) for n in self.list_commands(ctx)]


class RootGroup(ArealGroup):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.commands = _LazyCommands({name: partial(_load, name) for name in COMMANDS})

    def help_commands(self, ctx) -> list[tuple[str, str]]:
        return [(name, line) for name, (_, line) in COMMANDS.items()]


def _load(name: str):
    """The click command for `name`, built from its module's typer definitions."""
    module = importlib.import_module(f"areal_cli.commands.{COMMANDS[name][0]}")
    if hasattr(module, "app"):  # a group of sub-commands (doctor)
        return _group(name, module.app)
    sub = typer.Typer()
    module.register(sub)
    # A module may register several commands (ps, logs, stop): build the one asked for.
    return _command(next(info for info in sub.registered_commands if info.name == name))


def _group(name: str, app: typer.Typer):
    """`app` as a group whose sub-commands are built on demand (typer builds them all)."""
    shell = typer.Typer(rich_markup_mode=None)
    shell.info, shell.registered_callback = app.info, app.registered_callback
    shell.info.cls = ArealGroup
    group = typer.main.get_group(shell)
    group.name = name
    group.commands = _LazyCommands(
        {info.name: partial(_command, info) for info in app.registered_commands}
    )
    return group


def _command(info):
    if info.cls in (None, TyperCommand):
        info.cls = ArealCommand
    return typer.main.get_command_from_info(
        info, pretty_exceptions_short=True, rich_markup_mode=None
    )


def first_line(text: str | None) -> str:
    """A help text's first paragraph, on one line."""
    para = inspect.cleandoc(text or "").split("\n\n")[0]
    return " ".join(para.split())


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


def main(argv: list[str] | None = None) -> None:
    """Run the app; typed errors become one red message and their exit code."""
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        rc = app(args=argv, standalone_mode=False)
        if isinstance(rc, int) and rc:
            sys.exit(rc)
    except ArealError as e:
        from areal_cli import console

        if debug:
            console.err.print_exception()
        console.report_error(e)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        from areal_cli import console

        console.err.print("[yellow]interrupted[/]")
        sys.exit(EXIT_INTERRUPTED)
    except SystemExit:
        raise
    except Exception as e:
        # Usage errors from Typer's parser (Typer ships its own copy of click, so match by
        # shape rather than by class): print usage + message, exit 2.
        if hasattr(e, "show") and isinstance(getattr(e, "exit_code", None), int):
            e.show()
            sys.exit(e.exit_code)
        if type(e).__name__ == "Abort":
            sys.exit(EXIT_INTERRUPTED)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            # A full disk can meet any write (a lock, a log folder): one message naming it.
            from areal_cli import console, files, settings

            full = files.disk_full(e.filename or settings.home(), e)
            if debug:
                console.err.print_exception()
            console.report_error(full)
            sys.exit(full.exit_code)
        raise
    sys.exit(0)


if __name__ == "__main__":
    main()
