"""API keys of the servers a job starts: stored readable by the user only, beside the job's
record, and handed only to servers whose registry entry proves that job started them.

    <home>/jobs/<user>/<experiment>/<trial>/api_key.json   {"marker": ..., "key": ...}  0600

The proof: the replica runner that starts a server signs the server's registry metadata
(address, id, trial, job, marker, backend, heartbeat, TTL) with an HMAC under a key derived
from the job's API key, and signs it afresh with every heartbeat. Metadata is readable by
whoever reads the registry (an etcd without auth: every user of it), and anyone who can write
there can copy it under a new id pointing at their own server; without the key they cannot
make the signature match the new address, nor make an old signature look fresh. The HMAC
reveals nothing of the key, and real SGLang/vLLM servers need to answer nothing new.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
from pathlib import Path

from areal_cli import settings

# What a signature covers: where the key would go, whose server it is, and when it was said.
SIGNED_FIELDS = (
    *("id", "addr", "experiment", "trial", "job", "marker", "backend"),
    *("heartbeat", "ttl"),
)
_CONTEXT = b"areal registry entry v1"


def key_file(home: Path, experiment: str, trial: str) -> Path:
    return home / "jobs" / settings.user() / experiment / trial / "api_key.json"


def store(path: str | Path, marker: str, key: str) -> None:
    from areal_cli import files

    path = Path(path)
    files.private_dir(path.parent)
    files.write_atomic(path, json.dumps({"marker": marker, "key": key}), mode=0o600)


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


def _signing_key(key: str) -> bytes:
    # A key of its own for signatures: what an HMAC is computed with is never the API key.
    return hmac.new(key.encode(), _CONTEXT, hashlib.sha256).digest()


def sign(key: str, entry) -> str:
    """The signature of a server entry's SIGNED_FIELDS under the job's API key."""
    msg = json.dumps([getattr(entry, f, None) for f in SIGNED_FIELDS], separators=(",", ":"))
    return hmac.new(_signing_key(key), msg.encode(), hashlib.sha256).hexdigest()


def unproven(key: str, entry, now: float | None = None) -> str | None:
    """Why `entry` does not prove that the job holding `key` started its server, or None
    when it does: signed with that key, for this very address, within its TTL."""
    sig = getattr(entry, "signature", None)
    if not isinstance(sig, str) or not sig:
        return "its registry entry is not signed by the job that holds the key"
    if not hmac.compare_digest(sig, sign(key, entry)):
        return "its registry entry's signature does not match (copied, or pointed elsewhere)"
    try:
        age = (now or time.time()) - float(entry.heartbeat)
        fresh = abs(age) <= float(entry.ttl)
    except (TypeError, ValueError):
        return "its registry entry has no heartbeat"
    if not fresh:
        return f"its registry entry was last signed {age:.0f}s ago (TTL {entry.ttl:g}s)"
    return None
