"""The `areal` entry point: a Typer app whose commands load on demand; errors become exit codes.

Start-up is paid on every call, so only typer is imported, and only when a parser is needed
(the app lives in areal_cli._app). A command's module is imported when that command runs or
shows its help; `areal --help` lists the commands from the table in areal_cli.commands
without importing any of them. Help is drawn by `console.render_help` (typer's own renderer imports rich.markdown
and pygments). `areal doctor hang` with plain flags skips typer altogether (as `ps` and
`alloc` do): it is run beside a hung job, often many times, and typer's import was a third
of its start-up. Both parsers read one option table per command (commands.Opt).
"""

from __future__ import annotations

import errno
import os
import sys
import warnings

from areal_cli import __version__
from areal_cli.commands import COMMANDS, HELP, first_line, parse  # noqa: F401 (read here)
from areal_cli.errors import EXIT_INTERRUPTED, ArealError, ArealWarning


def __getattr__(name: str):
    # The typer app and its helpers (app, _load, ...) for code that reaches them through here.
    # Dunders are the import system asking (`from areal_cli.cli import main` looks for
    # __path__): answering those must not import typer.
    if name.startswith("__"):
        raise AttributeError(name)
    from areal_cli import _app

    try:
        return getattr(_app, name)
    except AttributeError:
        raise AttributeError(f"module 'areal_cli.cli' has no attribute {name!r}") from None


# The plain forms: command words -> (module in areal_cli.commands, its positional arguments).
# The module's OPTIONS are the table its typer command is built from; its `plain(**opts)`
# runs the command and returns the exit code.
FAST: dict[tuple[str, ...], tuple[str, tuple[str, ...]]] = {
    ("ps",): ("listing", ()),
    ("alloc",): ("alloc", ("text",)),
    ("doctor", "hang"): ("doctor_hang", ()),
}


def _fast(args: list[str]) -> int | None:
    """The exit code of a command run without typer, or None when typer must parse `args`.

    typer (with click) costs about 50 ms of start-up, twice a bare interpreter's: the
    commands scripts call in loops take their plain forms here (`--version`, `ps [--all]
    [--json]`, `alloc S [--json]`, `doctor hang` with plain flags), read with the option
    table the typer command is built from. Anything else, --help or a flag these forms do
    not take included, goes to typer, which parses and judges it."""
    if args == ["--version"]:
        print(f"areal {__version__}")
        return 0
    for words, (name, positional) in FAST.items():
        if tuple(args[: len(words)]) == words:
            import importlib

            module = importlib.import_module(f"areal_cli.commands.{name}")
            opts = parse(module.OPTIONS, args[len(words) :], positional)
            return None if opts is None else module.plain(**opts)
    return None


def main(argv: list[str] | None = None) -> None:
    """Run the app; typed errors become one red message and their exit code."""
    try:
        _main(argv)
    except SystemExit as e:
        plugins = sys.modules.get("areal_cli.plugins")
        if plugins is None or not plugins.exit_hooks:
            raise
        _leave(e.code, plugins.exit_hooks)


def _leave(code, hooks) -> None:
    """Exit at once where a plug-in asks (plugins.exit_hooks): its library's exit would
    take a second and more, and nothing is left to write."""
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if not any([hook() for hook in hooks]):  # a list: every hook runs
        sys.exit(code)
    os._exit(code or 0)


_python_show_warning = warnings.showwarning


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """The library's warnings (ArealWarning) as one yellow line; any other as Python shows it."""
    if not issubclass(category, ArealWarning):
        return _python_show_warning(message, category, filename, lineno, file, line)
    from areal_cli import console

    console.err.print(f"[yellow]warning:[/] {console._escape(str(message))}")


def _main(argv: list[str] | None) -> None:
    warnings.showwarning = _show_warning
    args = argv if argv is not None else sys.argv[1:]
    debug = "--debug" in args
    try:
        rc = _fast(args)
        if rc is None:
            from areal_cli._app import app

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
