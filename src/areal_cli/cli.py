"""The `areal` entry point: a Typer app whose commands load on demand; errors become exit codes.

Start-up is paid on every call, so only typer is imported, and only when a parser is needed
(the app lives in areal_cli._app). A command's module is imported when that command runs or
shows its help; `areal --help` lists the commands from the table below without importing any
of them. Help is drawn by `console.render_help` (typer's own renderer imports rich.markdown
and pygments). `areal doctor hang` with plain flags skips typer altogether: it is run
beside a hung job, often many times, and typer's import was a third of its start-up.
"""

from __future__ import annotations

import errno
import os
import sys
import warnings

from areal_cli.errors import EXIT_INTERRUPTED, ArealError, ArealWarning

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


def first_line(text: str | None) -> str:
    """A help text's first paragraph, on one line."""
    import inspect

    para = inspect.cleandoc(text or "").split("\n\n")[0]
    return " ".join(para.split())


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


def _fast(args: list[str]) -> int | None:
    """The exit code of a command run without typer, or None when typer must parse `args`.

    typer (with click) costs about 50 ms of start-up, twice a bare interpreter's: the
    commands scripts call in loops take their plain forms here (`--version`, `ps [--all]
    [--json]`, `alloc S [--json]`, `doctor hang` with plain flags). Anything else, --help or
    a flag these forms do not take included, goes to typer, which parses and judges it."""
    if args == ["--version"]:
        from areal_cli import __version__

        print(f"areal {__version__}")
        return 0
    if args[:1] == ["ps"] and _only_flags(args[1:], ("--all", "--json")):
        from areal_cli.commands import listing

        listing.show("--all" in args, None, "--json" in args)
        return 0
    if args[:1] == ["alloc"] and 2 <= len(args) <= 3:
        text = [a for a in args[1:] if a != "--json"]
        if len(text) == 1 and not text[0].startswith("-") and len(args) - 2 == ("--json" in args):
            from areal_cli.commands import alloc

            alloc.show(text[0], "--json" in args)
            return 0
    if args[:2] == ["doctor", "hang"]:
        from areal_cli.commands import doctor_hang

        opts = doctor_hang.parse_plain(args[2:])
        if opts is not None:
            return doctor_hang.run(**opts)
    return None


def _only_flags(args: list[str], allowed: tuple[str, ...]) -> bool:
    """Each of `args` is one of `allowed`, none twice."""
    return set(args) <= set(allowed) and len(set(args)) == len(args)


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
