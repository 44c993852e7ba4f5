"""`areal key E/T`: the API key of servers this user started, for a client of their own."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from areal_cli import settings
from areal_cli.errors import UsageError

from ._common import HomeOpt

HELP = """Print the API key of servers you started as E/T, for a client of your own.

The key goes to stdout or to a file readable by you only, never onto a command line
(every user of the host reads those): capture it into the environment of the client
that needs it. A trainer started with `areal train` gets it without asking.

\b
Examples:
  export AREAL_API_KEY=$(areal key myexp/trial0)
  areal key myexp/trial0 --env-file ~/.areal.env   # AREAL_API_KEY=...
  areal key myexp/trial0 --header-file ~/.areal.hdr
  curl -H @$HOME/.areal.hdr http://127.0.0.1:30000/model_info
"""


def register(app: typer.Typer) -> None:
    @app.command("key", help=HELP)
    def key(
        name: str = typer.Argument(..., help="The servers' job, EXPERIMENT/TRIAL."),
        file: Path = typer.Option(
            None, "--file", help="Write the key to FILE (mode 600) instead of stdout."
        ),
        env_file: Path = typer.Option(
            None,
            "--env-file",
            help="Write AREAL_API_KEY=... and OPENAI_API_KEY=... to FILE (mode 600).",
        ),
        header_file: Path = typer.Option(
            None,
            "--header-file",
            help="Write the line `Authorization: Bearer KEY` to FILE (mode 600), for "
            "`curl -H @FILE`.",
        ),
        home: Path = HomeOpt,
    ) -> None:
        from areal_cli import apikeys, console
        from areal_cli.schedulers.api import parse_name

        experiment, trial = parse_name(name)
        path = apikeys.key_file(settings.home(home), experiment, trial)
        held = apikeys.load(path)
        if held is None:
            raise UsageError(
                f"no API key of {experiment}/{trial} held by {settings.user()}",
                hint="its servers were started with --api-key none, by another user, or not "
                "at all (see `areal ps`); a key passed as --api-key KEY is the one you gave",
            )
        secret = held[1]
        files = {
            file: secret + "\n",
            env_file: f"AREAL_API_KEY={secret}\nOPENAI_API_KEY={secret}\n",
            header_file: f"Authorization: Bearer {secret}\n",
        }
        files.pop(None, None)
        if not files:
            typer.echo(secret)
            return
        for path, text in files.items():
            _write_private(path, text)
            console.err.print(f"[green]wrote[/] the key of {experiment}/{trial} to {path}")


def _write_private(path: Path, text: str) -> None:
    """Readable by this user only from its first byte: made 600 in a temporary file beside
    it, then renamed over it (never through a symlink someone left there)."""
    path = path.expanduser()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UsageError(f"cannot write {path}: {e.strerror or e}") from None
