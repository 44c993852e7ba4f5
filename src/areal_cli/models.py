"""What `--model` names: a local checkpoint directory or a Hugging Face hub id.

SGLang, vLLM and transformers all take a hub id (`org/name`) and resolve it themselves, from
their local cache or by downloading, so a hub id passes through as given, with `@revision`
split off for the backends' own `--revision` flag. Only what is clearly a local path that does
not exist is refused here: an absolute path, one starting with `./`, `../` or `~`, or a path
whose parent exists without that child.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from areal_cli.errors import UsageError

# Hub repository ids: at most one namespace; letters, digits, '-', '_', '.'.
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")
_REVISION = re.compile(r"^[\w./-]+$")
_MISSING_HINT = (
    "give a local model directory or a hub id (org/name); `areal init-model DIR` writes a tiny one"
)


@dataclass(frozen=True)
class ModelRef:
    name: str  # an absolute local directory, or the hub id as given (without @revision)
    revision: str | None = None
    local: bool = True
    # False: a local path that does not exist on this host (a dry run plans with it: on a
    # cluster the path may exist only on the compute nodes).
    found: bool = True

    def __str__(self) -> str:
        return self.name + (f"@{self.revision}" if self.revision else "")


def parse(text: str, cwd: Path | None = None, missing_ok: bool = False) -> ModelRef:
    """A local directory (made absolute) or a hub id; a usage error for a missing local path,
    or with `missing_ok` that path with found=False."""
    text = (text or "").strip()
    if not text:
        raise UsageError("--model is empty", hint=_MISSING_HINT)
    base = cwd or Path.cwd()
    path = Path(text).expanduser()
    full = path if path.is_absolute() else base / path
    if full.exists():
        if not full.is_dir():
            raise UsageError(
                f"model path {full} is a file, not a checkpoint directory", hint=_MISSING_HINT
            )
        return ModelRef(str(full.resolve()))
    explicit = text.startswith(("/", "./", "../", "~")) or text in (".", "..")
    if explicit:
        return _missing(full, missing_ok)
    name, _, revision = text.partition("@")
    if "@" in text and not (revision and _REVISION.match(revision)):
        raise UsageError(f"--model {text!r}: bad revision after '@'", hint="e.g. org/name@main")
    if not _HUB_ID.match(name) or ".." in name:
        raise UsageError(
            f"--model {text!r} is neither a local directory nor a hub id", hint=_MISSING_HINT
        )
    # "runs/ckpt" with ./runs present but no ckpt in it is a typo of a local path, not a hub id.
    parent = (base / name).parent
    if parent != base and parent.is_dir():
        return _missing(base / name, missing_ok)
    if "/" not in name and os.path.isdir(base):
        if missing_ok:
            return _missing(base / name, missing_ok)
        raise UsageError(
            f"model path {base / name} does not exist",
            hint=_MISSING_HINT + "; a hub id has the form org/name",
        )
    return ModelRef(name, revision or None, local=False)


def _missing(path: Path, missing_ok: bool) -> ModelRef:
    if not missing_ok:
        raise UsageError(f"model path {path} does not exist", hint=_MISSING_HINT)
    return ModelRef(str(path), found=False)
