"""`areal key E/T`: the API key of servers this user started, for a client of their own."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from areal_cli import apikeys, console, files, settings
from areal_cli.commands import Opt
from areal_cli.errors import UsageError
from areal_cli.schedulers.api import parse_name

from ._common import HomeOpt, RegistryOpt

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


# Where the key may go, each a file (mode 600) or `-` for stdout.
OUTPUTS = {
    opt.key: opt
    for opt in (
        Opt("file", "--file",
            help="Write the key to FILE (mode 600); `-`: stdout (the default)."),
        Opt("env_file", "--env-file",
            help="Write AREAL_API_KEY=... and OPENAI_API_KEY=... to FILE (mode 600)."),
        Opt("header_file", "--header-file",
            help="Write the line `Authorization: Bearer KEY` to FILE (mode 600), for "
            "`curl -H @FILE`."),
    )
}  # fmt: skip


def register(app: typer.Typer) -> None:
    @app.command("key", help=HELP)
    def key(
        name: str = typer.Argument(..., help="The servers' job, EXPERIMENT/TRIAL."),
        file: Path = OUTPUTS["file"].option(),
        env_file: Path = OUTPUTS["env_file"].option(),
        header_file: Path = OUTPUTS["header_file"].option(),
        home: Path = HomeOpt,
        registry: str = RegistryOpt,
    ) -> None:
        experiment, trial = parse_name(name)
        outputs = _outputs(file=file, env_file=env_file, header_file=header_file)
        path = apikeys.key_file(settings.home(home), experiment, trial)
        held = apikeys.load(path)
        if held is None:
            raise UsageError(
                f"no API key of {experiment}/{trial} held by {settings.user()}",
                hint="its servers were started with --api-key none, by another user, or not "
                "at all (see `areal ps`); a key passed as --api-key KEY is the one you gave",
            )
        secret = held[1]
        texts = {
            "file": secret + "\n",
            "env_file": f"AREAL_API_KEY={secret}\nOPENAI_API_KEY={secret}\n",
            "header_file": f"Authorization: Bearer {secret}\n",
        }
        if not outputs:
            typer.echo(secret)
            return
        for opt, path in outputs.items():
            text = texts[opt]
            if path is None:
                typer.echo(text, nl=False)
                continue
            _write_private(path, text)
            console.err.print(f"[green]wrote[/] the key of {experiment}/{trial} to {path}")


def _outputs(**given: Path | None) -> dict[str, Path | None]:
    """Each output asked for: its file, or None for `-` (stdout). Two outputs naming one
    place are refused (one would silently overwrite the other), and so is a place that is
    not a regular file (files.check_replaceable), before anything is written."""
    out: dict[str, Path | None] = {}
    seen: dict[str, str] = {}
    for opt, value in given.items():
        if value is None:
            continue
        flag = "--" + opt.replace("_", "-")
        raw = str(value)
        if not raw.strip():
            raise UsageError(f"{flag} '': an empty path names no file", hint="`-` prints it")
        path = None if raw == "-" else Path(os.path.abspath(Path(raw).expanduser()))
        where = "stdout" if path is None else str(path)
        if where in seen:
            raise UsageError(
                f"{seen[where]} and {flag} both name {where}: one would overwrite the other",
                hint="give each output a file of its own",
            )
        seen[where] = flag
        if path is not None:
            files.check_replaceable(path)
        out[opt] = path
    return out


def _write_private(path: Path, text: str) -> None:
    """Readable by this user only from its first byte: made 600 in a temporary file beside
    it, then renamed over it. Only a regular file (or nothing) is replaced, never a symlink,
    a device, a FIFO or a folder (files.write_atomic)."""
    try:
        files.write_atomic(path, text, mode=0o600)
    except files.UnsafePath:
        raise
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror or e}") from None
