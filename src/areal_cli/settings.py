"""Where things live: defaults from the environment, one place for every command."""

from __future__ import annotations

import os
import re
from pathlib import Path

from areal_cli import files
from areal_cli.errors import UsageError

DEFAULT_REGISTRY = "/tmp/areal/name_resolve"
# Same defaults for every command, so `areal serve` then `areal train` meet each other.
DEFAULT_EXPERIMENT = "default"
DEFAULT_TRIAL = "trial0"


def user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except Exception:  # no passwd entry in some containers
        return str(os.getuid())


def hostname() -> str:
    import socket  # 3-5 ms: only for commands that look at processes or servers

    return socket.gethostname()


def home(override: str | Path | None = None) -> Path:
    """AREAL_HOME: job records and logs. A home given (`--home`, AREAL_HOME) that is empty
    or is not a folder is a UsageError: read as no home, it would answer "no jobs running"
    about jobs that run."""
    if override is not None:
        return _checked_home(str(override), "--home")
    env = os.environ.get("AREAL_HOME")
    if env:
        return _checked_home(env, "AREAL_HOME")
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "areal"


def _checked_home(raw: str, source: str) -> Path:
    if not raw.strip():
        raise UsageError(f"{source} is empty", hint="name the folder of your job records")
    path = Path(raw).expanduser().resolve()
    # The nearest part that exists must be a folder: a new home is made under it later.
    # (os.path's checks: a part this user may not look into is no error of this check.)
    for part in (path, *path.parents):
        if os.path.exists(part):
            if not os.path.isdir(part):
                what = "is" if part == path else f"lies under {part}, which is"
                raise UsageError(
                    f"{source} {raw} {what} not a folder",
                    hint="name the folder of your job records (AREAL_HOME)",
                )
            break
    return path


# The registry scheme whose URLs are paths: a registry given as a path is one of these.
PATH_SCHEME = "file"
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def registry_url(override: str | Path | None = None) -> str:
    """AREAL_REGISTRY: a directory (AReaL's NFS name_resolve layout; `file://` optional) or
    the URL of another registry plug-in (`etcd://host:port[,host:port...]`). Paths come back
    absolute, URLs as given."""
    raw = str(override) if override else os.environ.get("AREAL_REGISTRY") or DEFAULT_REGISTRY
    found = _SCHEME.match(raw)
    if found and found.group(1) != PATH_SCHEME:
        return raw
    raw = raw[found.end() :] if found else raw
    return str(Path(raw).expanduser().resolve())


def registry_scheme(url: str | Path | None = None) -> str:
    """The scheme of the registry at `url` (registry_url's rules): its plug-in's name."""
    found = _SCHEME.match(registry_url(url))
    return found.group(1) if found else PATH_SCHEME


def use_registry(value: str) -> None:
    """`--registry VALUE`: the registry of this process and of what it starts, as if
    AREAL_REGISTRY=VALUE had been exported."""
    os.environ["AREAL_REGISTRY"] = str(value)


def port_base(default: int) -> int:
    """AREAL_PORT_BASE: where the search for free server ports starts when --port-base is not
    given (users sharing a node can keep apart this way)."""
    raw = os.environ.get("AREAL_PORT_BASE")
    if not raw:
        return default
    if not raw.isdigit() or not 1024 <= int(raw) <= 65000:
        raise UsageError(f"AREAL_PORT_BASE={raw!r} is not a port in 1024..65000")
    return int(raw)


def registry_ttl() -> float:
    """AREAL_REGISTRY_TTL: seconds a registered server or rank outlives its last renewal
    (renewed every third of it). Shorter drops dead hosts sooner and costs more writes."""
    return _seconds("AREAL_REGISTRY_TTL", "30", 1, 3600)


def log_dir(home_dir: Path, experiment: str, trial: str) -> Path:
    return home_dir / "logs" / user() / experiment / trial


def ensure_dir(path: Path | str, what: str = "--home (or AREAL_HOME)") -> Path:
    """mkdir -p of a folder only this user can write (files.private_dir: 0700 whatever the
    umask, refused when another user could write or swap it), with a usage error naming the
    flag to change when it cannot be made."""
    path = Path(path)
    try:
        files.private_dir(path)
    except OSError as e:
        raise UsageError(
            f"cannot create {path}: {e.strerror or e}", hint=f"pick a writable {what}"
        ) from None
    return path


def slurm_timeout() -> float:
    """AREAL_SLURM_TIMEOUT: seconds one Slurm command (squeue, scancel, sinfo; sbatch twice
    that) may take before the controller counts as not answering."""
    return _seconds("AREAL_SLURM_TIMEOUT", "30", 0.5, 600)


def _seconds(name: str, default: str, low: float, high: float) -> float:
    """The environment variable `name`: a number of seconds in low..high (a UsageError
    naming the variable and its value when it is not one)."""
    raw = os.environ.get(name, default)
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")  # fails the range check below, with the same message
    if not low <= value <= high:
        raise UsageError(f"{name}={raw!r} is not a number of seconds in {low:g}..{high:g}")
    return value
