"""The server registry: AReaL's NFS name_resolve layout, so AReaL and `areal` find each other.

    <root>/<user>/<experiment>/<trial>/gen_servers/<id>/ENTRY        "host:port"
    <root>/<user>/<experiment>/<trial>/gen_servers_meta/<id>/ENTRY   JSON metadata

AReaL's reader walks `gen_servers/` and takes every directory holding exactly one file named
ENTRY, so metadata lives under a sibling key, never beside ENTRY. Writes are atomic (temp file
in the parent directory + rename). Readers never get entries of dead servers: a pid gone on this
host, or a heartbeat older than the entry's TTL.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from areal_cli import procs, settings

SERVERS_KEY = "gen_servers"
META_KEY = "gen_servers_meta"
DEFAULT_TTL = 30.0  # seconds without a heartbeat before an entry counts as dead


@dataclass
class ServerEntry:
    id: str
    addr: str  # host:port
    experiment: str
    trial: str
    backend: str | None = None
    model_path: str | None = None
    tp: int = 1
    gpus: list[int] = field(default_factory=list)
    host: str | None = None  # the machine the process runs on
    pid: int | None = None
    pid_create_time: float | None = None
    started: float | None = None
    heartbeat: float | None = None
    ttl: float = DEFAULT_TTL
    api_key_required: bool = False
    weight_version: str | None = None
    job: str | None = None  # experiment/trial of the areal job that registered it
    marker: str | None = None  # that job's marker: teardown removes its own entries only
    # False for entries without our metadata (e.g. registered by AReaL itself).
    managed: bool = True

    def is_alive(self, now: float | None = None, _cache: dict | None = None) -> bool:
        if not self.managed:
            return True  # nothing to judge by; the caller's health probe decides
        if self.host == settings.hostname() and self.pid is not None:
            key = (self.pid, self.pid_create_time)
            alive = _cache.get(key) if _cache is not None else None
            if alive is None:
                alive = procs.pid_alive(self.pid, self.pid_create_time)
                if _cache is not None:
                    _cache[key] = alive
            if not alive:
                return False
        if self.heartbeat is not None:
            return (now or time.time()) - self.heartbeat <= self.ttl
        return True

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Listing:
    servers: list[ServerEntry]
    # Entries skipped because they are dead, corrupt or half-written: (path, reason).
    skipped: list[tuple[str, str]] = field(default_factory=list)


class FileRegistry:
    def __init__(self, root: Path | str, user: str | None = None):
        self.root = Path(root)
        self.user = user or settings.user()

    def trial_dir(self, experiment: str, trial: str) -> Path:
        return self.root / self.user / experiment / trial

    def servers_dir(self, experiment: str, trial: str) -> Path:
        return self.trial_dir(experiment, trial) / SERVERS_KEY

    def register(self, entry: ServerEntry) -> None:
        now = time.time()
        entry.started = entry.started or now
        entry.heartbeat = now
        # Metadata first: a reader that sees the ENTRY can always find its metadata.
        self._write(self._meta_file(entry), json.dumps(entry.to_json()))
        self._write(self._entry_file(entry), entry.addr)

    def heartbeat(self, entry: ServerEntry, **updates) -> None:
        for k, v in updates.items():
            setattr(entry, k, v)
        entry.heartbeat = time.time()
        self._write(self._meta_file(entry), json.dumps(entry.to_json()))

    def deregister(self, experiment: str, trial: str, server_id: str) -> None:
        for key in (SERVERS_KEY, META_KEY):
            d = self.trial_dir(experiment, trial) / key / server_id
            shutil.rmtree(d, ignore_errors=True)
            _prune_empty(d.parent, stop=self.root)

    def deregister_job(self, experiment: str, trial: str, marker: str) -> int:
        """Remove the entries one job registered (not those of another job in the trial)."""
        gone = 0
        for e in self.list(experiment, trial, include_dead=True).servers:
            if e.managed and e.marker == marker:
                self.deregister(experiment, trial, e.id)
                gone += 1
        return gone

    def list(
        self, experiment: str | None = None, trial: str | None = None, include_dead: bool = False
    ) -> Listing:
        """Registered servers of one trial, one experiment, or (None, None) the whole user tree."""
        base = self.root / self.user
        if experiment and trial:
            trial_dirs = [base / experiment / trial]
        elif experiment:
            trial_dirs = [Path(t) for t in _subdirs(base / experiment)]
        else:
            trial_dirs = [Path(t) for e in _subdirs(base) for t in _subdirs(e)]
        out = Listing(servers=[])
        now = time.time()
        alive_cache: dict = {}
        for tdir in trial_dirs:
            sdir = tdir / SERVERS_KEY
            for d in _subdirs(sdir):
                entry, reason = self._read(tdir, d)
                if entry is None:
                    out.skipped.append((str(d), reason or "unreadable"))
                elif include_dead or entry.is_alive(now, alive_cache):
                    out.servers.append(entry)
                else:
                    out.skipped.append((str(d), "dead"))
        out.servers.sort(key=lambda e: (e.experiment, e.trial, e.id))
        return out

    def prune(self, experiment: str | None = None, trial: str | None = None) -> int:
        """Remove entries of dead servers; returns how many went."""
        listing = self.list(experiment, trial, include_dead=True)
        gone = 0
        for e in listing.servers:
            if e.managed and not e.is_alive():
                self.deregister(e.experiment, e.trial, e.id)
                gone += 1
        return gone

    def _read(self, tdir: Path, d: str) -> tuple[ServerEntry | None, str | None]:
        # Plain strings and os calls: this runs once per server on every listing.
        experiment, trial = tdir.parent.name, tdir.name
        try:
            # ENTRY is only ever renamed into place, so if it opens it is whole, even with a
            # writer's temp file beside it.
            addr = _slurp(os.path.join(d, "ENTRY")).decode(errors="replace").strip()
        except FileNotFoundError:
            files = _files(d)
            return None, "half-written" if any(".tmp" in f for f in files) else "no ENTRY"
        except OSError:
            return None, "unreadable ENTRY"
        if not _looks_like_addr(addr):
            return None, f"ENTRY holds {addr[:40]!r}, not host:port"
        sid = os.path.basename(d)
        meta_file = os.path.join(str(tdir), META_KEY, sid, "ENTRY")
        try:
            raw = _slurp(meta_file)
        except FileNotFoundError:
            return ServerEntry(
                id=sid, addr=addr, experiment=experiment, trial=trial, managed=False
            ), None
        except OSError:
            return None, "unreadable metadata"
        try:
            meta = json.loads(raw)
            meta.update(id=sid, addr=addr, experiment=experiment, trial=trial)
            return ServerEntry(**{k: v for k, v in meta.items() if k in _FIELDS}), None
        except (ValueError, TypeError, AttributeError):
            return None, "corrupt metadata"

    def _entry_file(self, e: ServerEntry) -> Path:
        return self.servers_dir(e.experiment, e.trial) / e.id / "ENTRY"

    def _meta_file(self, e: ServerEntry) -> Path:
        return self.trial_dir(e.experiment, e.trial) / META_KEY / e.id / "ENTRY"

    def _write(self, path: Path, text: str) -> None:
        if not self.root.exists():
            # Shared by every user of the host (each writes under its own name), like /tmp.
            self.root.mkdir(parents=True, exist_ok=True)
            try:
                os.chmod(self.root, 0o1777)
            except OSError:
                pass
        path.parent.mkdir(parents=True, exist_ok=True)
        # The temp file sits in the parent, not beside ENTRY: AReaL's reader would skip a
        # directory holding two files, and ours would call it half-written.
        tmp = path.parent.parent / f".{path.parent.name}.{os.getpid()}.tmp"
        tmp.write_text(text)
        os.replace(tmp, path)


def server_id(host: str, port: int) -> str:
    return f"{host}_{port}"


def _looks_like_addr(s: str) -> bool:
    host, sep, port = s.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def _subdirs(p: Path | str) -> list[str]:
    try:
        return [e.path for e in os.scandir(p) if e.is_dir() and not e.name.startswith(".")]
    except OSError:
        return []


def _files(p: str) -> list[str]:
    try:
        return sorted(os.listdir(p))
    except OSError:
        return []


def _slurp(path: str) -> bytes:
    # Entries are a few hundred bytes: a small first read avoids allocating a big buffer
    # a thousand times per listing.
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.read(fd, 4096)
        while len(data) % 4096 == 0 and data:
            more = os.read(fd, 65536)
            if not more:
                break
            data += more
        return data
    finally:
        os.close(fd)


_FIELDS = frozenset(ServerEntry.__dataclass_fields__)


def _prune_empty(d: Path, stop: Path) -> None:
    while d != stop and stop in d.parents:
        try:
            d.rmdir()
        except OSError:
            return
        d = d.parent
