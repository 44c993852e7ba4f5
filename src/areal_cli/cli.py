"""The `areal` entry point: a thin Typer app that wires command groups and maps errors to exit codes.

Nothing heavy is imported here: `areal --help` must stay fast. Commands import torch,
transformers or server code inside the function that needs it.
"""

from __future__ import annotations

import os
import sys

import typer

from areal_cli import __version__
from areal_cli.commands import alloc as alloc_cmd
from areal_cli.commands import doctor as doctor_cmd
from areal_cli.commands import init_model as init_model_cmd
from areal_cli.commands import jobs as jobs_cmd
from areal_cli.commands import serve as serve_cmd
from areal_cli.commands import train as train_cmd
from areal_cli.errors import EXIT_INTERRUPTED, ArealError

app = typer.Typer(
    name="areal",
    help=(
        "Launch and diagnose RL post-training jobs for LLMs.\n\n"
        "  areal serve --backend hf --model ./tiny --detach\n\n"
        "  areal train --alloc fsdp:d2 templates/grpo/train.py --config tiny_cpu.yaml\n\n"
        "  areal ps · areal logs E/T -f · areal stop E/T · areal doctor hang --job E/T"
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
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


serve_cmd.register(app)
train_cmd.register(app)
jobs_cmd.register(app)
alloc_cmd.register(app)
init_model_cmd.register(app)
app.add_typer(doctor_cmd.app, name="doctor")


def main(argv: list[str] | None = None) -> None:
    """Run the app; typed errors become one red message and their exit code."""
    from areal_cli import console

    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        rc = app(args=argv, standalone_mode=False)
        if isinstance(rc, int) and rc:
            sys.exit(rc)
    except ArealError as e:
        if debug:
            console.err.print_exception()
        console.report_error(e)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
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
        raise
    sys.exit(0)


if __name__ == "__main__":
    main()
