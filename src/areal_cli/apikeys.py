"""API keys of the servers a job starts: stored readable by the user only, beside the job's
record, and handed only to servers whose registry metadata says that job started them.

    <home>/jobs/<user>/<experiment>/<trial>/api_key.json   {"marker": ..., "key": ...}  0600
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from areal_cli import settings


def key_file(home: Path, experiment: str, trial: str) -> Path:
    return home / "jobs" / settings.user() / experiment / trial / "api_key.json"


def store(path: str | Path, marker: str, key: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"marker": marker, "key": key}, f)
    os.replace(tmp, path)


def load(path: str | Path) -> tuple[str, str] | None:
    """(marker, key), or None when there is no readable key file of ours."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            return None  # not ours, or readable by others: not a key we hand out
        d = json.loads(os.read(fd, 4096))
        return str(d["marker"]), str(d["key"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    finally:
        os.close(fd)
