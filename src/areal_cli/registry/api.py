"""The registry every part of areal shares: which inference servers and training ranks are alive.

Keys are AReaL's name_resolve names, so AReaL finds servers that `areal serve` started and
`areal train` finds servers that AReaL registered:

    <user>/<experiment>/<trial>/gen_servers/<id>      "host:port"   AReaL reads this subtree
    <user>/<experiment>/<trial>/areal/servers/<id>    JSON          our metadata of that server
    <user>/<experiment>/<trial>/areal/ranks/<rank>    JSON          a live training rank

AReaL reads server addresses with a plain prefix read of `.../gen_servers` (no trailing
slash), so nothing of ours may start with that prefix: our keys live under `areal/`.

Every entry is written under a lease with a TTL and renewed while its process lives
(`keepalive`). A backend either expires keys itself (etcd) or the reader judges by the
heartbeat in the metadata and by the pid on this host (the file backend). Backends implement a
small key/value interface; everything about entries (layout, parsing, liveness, what is
skipped and why) lives here once.
"""

from __future__ import annotations

import json
import re
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, fields

from areal_cli import apikeys, settings

SERVERS_KEY = "gen_servers"
OWN_KEY = "areal"
DEFAULT_TTL = 30.0  # seconds an entry outlives its last renewal

_ADDR = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.:-]+):[0-9]{1,5}$")


@dataclass
class ServerEntry:
    id: str
    addr: str  # host:port
    experiment: str
    trial: str
    backend: str | None = None
    model_path: str | None = None  # as given: a directory or a hub id
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
    scheduler: str = "local"
    scheduler_job_id: str | None = None  # Slurm job id (and step) when run by Slurm
    node: str | None = None
    lease: str | None = None  # the backend's lease, when it has real ones (etcd)
    # HMAC of the entry under its job's API key, renewed with the heartbeat (apikeys.sign).
    signature: str | None = None
    # False for entries without our metadata (e.g. registered by AReaL itself).
    managed: bool = True
    # Requests it answered with errors in the last minute, as its runner read them
    # (areal_cli.request_errors); None where nothing was read.
    errors: dict | None = None
    # The engine's package version in the server's interpreter (sglang, vllm), where its
    # runner could read it: what AReaL's trainer is paired against (areal_entry).
    engine_version: str | None = None
    # How often its runner started the server again after it exited (launchers/replica.py):
    # a restarted server holds its base weights again, from `started` on.
    restarts: int = 0

    def is_alive(self, now: float | None = None, pid_cache: dict | None = None) -> bool:
        if not self.managed:
            return True  # nothing to judge by; the caller's health probe decides
        return _alive(self, now, pid_cache)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class RankEntry:
    """One training rank while it lives: where to find it (host, pid) and what it is."""

    experiment: str
    trial: str
    rank: int
    local_rank: int
    world_size: int
    host: str
    pid: int
    pid_create_time: float | None = None
    job: str | None = None
    marker: str | None = None
    scheduler: str = "local"
    scheduler_job_id: str | None = None
    node: str | None = None
    started: float | None = None
    heartbeat: float | None = None
    ttl: float = DEFAULT_TTL
    lease: str | None = None

    def is_alive(self, now: float | None = None, pid_cache: dict | None = None) -> bool:
        return _alive(self, now, pid_cache)

    def to_json(self) -> dict:
        return asdict(self)


def _alive(entry: ServerEntry | RankEntry, now: float | None, cache: dict | None) -> bool:
    if entry.host == settings.hostname() and entry.pid is not None:
        key = (entry.pid, entry.pid_create_time)
        alive = cache.get(key) if cache is not None else None
        if alive is None:
            from areal_cli import procs

            alive = procs.pid_alive(entry.pid, entry.pid_create_time)
            if cache is not None:
                cache[key] = alive
        if not alive:
            return False
    if entry.lease is not None:
        return True  # the backend drops the key when its lease runs out
    if entry.heartbeat is not None:
        return (now or time.time()) - entry.heartbeat <= entry.ttl
    return True


@dataclass
class Listing:
    servers: list[ServerEntry]
    # Entries skipped because they are dead, corrupt, half-written or untrusted: (key, reason).
    skipped: list[tuple[str, str]] = field(default_factory=list)


def server_id(host: str, port: int) -> str:
    return f"{host}_{port}"


def looks_like_addr(s: str) -> bool:
    if not _ADDR.match(s):
        return False
    return 0 < int(s.rpartition(":")[2]) < 65536


_SERVER_FIELDS = frozenset(f.name for f in fields(ServerEntry))
_RANK_FIELDS = frozenset(f.name for f in fields(RankEntry))


class Registry(ABC):
    """Servers and ranks of every job, for one user, in one backend.

    Subclasses store text values under '/'-separated keys: `_put`, `_read_prefix`, `_delete`,
    and leases (`_grant`, `_keepalive`, `_revoke`). A value read back is a str, or a reason
    (`Skip`) why it cannot be trusted or read.
    """

    url: str  # printable; never holds a password
    user: str
    kind: str  # its scheme: "file", "etcd", or a plug-in's
    # Whether its entries are files under the folder its url names: then the nodes of a
    # multi-node job see each other's only through a filesystem every node mounts.
    shared_filesystem: bool = False
    # What becomes of entries a stop could not remove when the registry itself drops them
    # (leases); None: readers skip them by their servers' pids and heartbeats.
    leftovers_expire: str | None = None

    @classmethod
    def from_url(cls, url: str) -> Registry:
        """The registry at `url` (settings.registry_url's form: a path for scheme file)."""
        return cls(url)

    # -- backend primitives ---------------------------------------------------------------

    @abstractmethod
    def _put(self, key: str, value: str, lease: str | None = None) -> None: ...

    @abstractmethod
    def _read_prefix(self, prefix: str) -> dict[str, str | Skip]:
        """Every value under `prefix/` (a whole key segment), by full key."""

    @abstractmethod
    def _delete(self, key: str) -> bool:
        """Remove `key`: True when it was there, False when it was gone already; raises
        when it cannot be removed (a read-only registry, one that does not answer)."""

    def _grant(self, ttl: float) -> str | None:
        """A lease of `ttl` seconds, or None where the reader judges heartbeats instead."""
        return None

    def _keepalive(self, lease: str) -> None:
        return None

    def _revoke(self, lease: str) -> None:
        return None

    def where(self, experiment: str, trial: str) -> str:
        """Where servers of E/T are looked for, in words for an error message."""
        return f"{self.url} key {self._trial_key(experiment, trial)}/{SERVERS_KEY}"

    def areal_name_resolve(self) -> list[str]:
        """AReaL config overrides that point its name_resolve at this registry."""
        raise NotImplementedError

    def users(self) -> list[str]:
        """Every user with entries here (for accounting of what other users hold)."""
        return [self.user]

    def close(self) -> None:
        return None

    def probe(self) -> None:
        """Write, read back and delete a scratch key; raises what the backend raises."""
        import uuid

        key = f"{self.user}/{OWN_KEY}-check/{uuid.uuid4().hex[:8]}"
        self._put(key, "ok")
        try:
            got = self._read_prefix(key.rpartition("/")[0]).get(key)
            if got != "ok":
                raise OSError(f"read back {got!r} instead of what was written")
        finally:
            self._delete(key)

    def for_user(self, user: str) -> Registry:
        """The same registry, read as another user's."""
        raise NotImplementedError

    # -- servers --------------------------------------------------------------------------

    def _trial_key(self, experiment: str, trial: str) -> str:
        return f"{self.user}/{experiment}/{trial}"

    def register(
        self, entry: ServerEntry, ttl: float = DEFAULT_TTL, sign_with: str | None = None
    ) -> None:
        """Publish a server under a lease of `ttl` seconds; renew with `keepalive`. With
        `sign_with` (the job's API key) the metadata carries its signature (apikeys.sign)."""
        now = time.time()
        entry.started = entry.started or now
        entry.heartbeat, entry.ttl = now, ttl
        entry.lease = self._grant(ttl)
        if sign_with:
            entry.signature = apikeys.sign(sign_with, entry)
        base = self._trial_key(entry.experiment, entry.trial)
        # Metadata first: a reader that sees the address can always find its metadata.
        self._put(f"{base}/{OWN_KEY}/servers/{entry.id}", json.dumps(entry.to_json()), entry.lease)
        self._put(f"{base}/{SERVERS_KEY}/{entry.id}", entry.addr, entry.lease)

    def keepalive(self, entry: ServerEntry, sign_with: str | None = None, **updates) -> None:
        """Renew the entry's lease; `updates` change fields of its metadata too. A signed
        entry is signed afresh: readers take a signature older than the TTL for a replay."""
        for k, v in updates.items():
            setattr(entry, k, v)
        entry.heartbeat = time.time()
        if sign_with:
            entry.signature = apikeys.sign(sign_with, entry)
        if entry.lease is not None:
            self._keepalive(entry.lease)
            if not updates and not sign_with:
                return
        base = self._trial_key(entry.experiment, entry.trial)
        self._put(f"{base}/{OWN_KEY}/servers/{entry.id}", json.dumps(entry.to_json()), entry.lease)

    def deregister(self, experiment: str, trial: str, sid: str, lease: str | None = None) -> bool:
        """Remove a server's entries; True when this removed them (False: already gone)."""
        base = self._trial_key(experiment, trial)
        gone = self._delete(f"{base}/{SERVERS_KEY}/{sid}")
        gone = self._delete(f"{base}/{OWN_KEY}/servers/{sid}") or gone
        if lease is not None:
            self._revoke(lease)
        return gone

    def deregister_job(self, experiment: str, trial: str, marker: str) -> int:
        """Remove the entries one job registered (servers and ranks), not another job's.
        Returns how many servers' entries this removed; raises when it cannot remove them."""
        gone = 0
        for e in self.list(experiment, trial, include_dead=True).servers:
            if e.managed and e.marker == marker:
                gone += self.deregister(experiment, trial, e.id, e.lease)
        for r in self.ranks(experiment, trial, include_dead=True):
            if r.marker == marker:
                self.deregister_rank(r)
        # The trial's last job: what AReaL's trainer left under it goes with it.
        if not self.list(experiment, trial).servers and not self.ranks(experiment, trial):
            self.clear_foreign(experiment, trial)
        return gone

    def clear_foreign(self, experiment: str, trial: str) -> int:
        """Remove the keys other programs wrote under the trial, in this user's own tree:
        AReaL's trainer writes `update_weights_from_disk/<version>` (and its workers' keys)
        there through its name_resolve, and its own launcher clears the trial before a run
        (areal/infra/launcher/local.py). Servers (gen_servers) and our metadata stay: their
        jobs remove them. Returns how many keys went; a key the reader does not trust (not
        this user's) is left."""
        base = self._trial_key(experiment, trial)
        gone = 0
        for key, value in self._read_prefix(base).items():
            parts = key.split("/")
            if isinstance(value, Skip) or len(parts) < 4 or parts[3] in (SERVERS_KEY, OWN_KEY):
                continue
            gone += self._delete(key)
        return gone

    def list(
        self, experiment: str | None = None, trial: str | None = None, include_dead: bool = False
    ) -> Listing:
        """Registered servers of one trial, one experiment, or (None, None) the whole user tree."""
        values = self._read_prefix(self._scope(experiment, trial))
        out = Listing(servers=[])
        now, cache = time.time(), {}
        for key, value in values.items():
            parts = key.split("/")
            if isinstance(value, Skip):
                # Our metadata is reported with its server; anything else the reader refused
                # (an untrusted folder, a half-written entry) is reported here.
                if parts[3:4] != [OWN_KEY]:
                    out.skipped.append((key, value.reason))
                continue
            # <user>/<experiment>/<trial>/gen_servers/<id>
            if len(parts) != 5 or parts[3] != SERVERS_KEY:
                continue
            addr = value.strip()
            if not looks_like_addr(addr):
                out.skipped.append((key, f"holds {addr[:40]!r}, not host:port"))
                continue
            meta = values.get(f"{'/'.join(parts[:3])}/{OWN_KEY}/servers/{parts[4]}")
            entry = _server_from(parts[4], addr, parts[1], parts[2], meta)
            if isinstance(entry, str):
                out.skipped.append((key, entry))
            elif include_dead or entry.is_alive(now, cache):
                out.servers.append(entry)
            else:
                out.skipped.append((key, "dead"))
        out.servers.sort(key=lambda e: (e.experiment, e.trial, e.id))
        return out

    def prune(self, experiment: str | None = None, trial: str | None = None) -> int:
        """Remove entries of dead servers and ranks; returns how many servers went."""
        gone = 0
        for e in self.list(experiment, trial, include_dead=True).servers:
            if e.managed and not e.is_alive():
                gone += self.deregister(e.experiment, e.trial, e.id, e.lease)
        if experiment and trial:
            for r in self.ranks(experiment, trial, include_dead=True):
                if not r.is_alive():
                    self.deregister_rank(r)
        return gone

    # -- ranks ----------------------------------------------------------------------------

    def register_rank(self, entry: RankEntry, ttl: float = DEFAULT_TTL) -> None:
        now = time.time()
        entry.started = entry.started or now
        entry.heartbeat, entry.ttl = now, ttl
        entry.lease = self._grant(ttl)
        self._put(self._rank_key(entry), json.dumps(entry.to_json()), entry.lease)

    def keepalive_rank(self, entry: RankEntry) -> None:
        entry.heartbeat = time.time()
        if entry.lease is not None:
            self._keepalive(entry.lease)
        else:
            self._put(self._rank_key(entry), json.dumps(entry.to_json()))

    def deregister_rank(self, entry: RankEntry) -> None:
        self._delete(self._rank_key(entry))
        if entry.lease is not None:
            self._revoke(entry.lease)

    def ranks(self, experiment: str, trial: str, include_dead: bool = False) -> list[RankEntry]:
        prefix = f"{self._trial_key(experiment, trial)}/{OWN_KEY}/ranks"
        out, now, cache = [], time.time(), {}
        for value in self._read_prefix(prefix).values():
            if isinstance(value, Skip):
                continue
            try:
                d = json.loads(value)
                r = RankEntry(**{k: v for k, v in d.items() if k in _RANK_FIELDS})
            except (ValueError, TypeError, AttributeError):
                continue
            if include_dead or r.is_alive(now, cache):
                out.append(r)
        return sorted(out, key=lambda r: r.rank)

    def _rank_key(self, e: RankEntry) -> str:
        return f"{self._trial_key(e.experiment, e.trial)}/{OWN_KEY}/ranks/{e.rank}"

    # -- layout ---------------------------------------------------------------------------

    def _scope(self, experiment: str | None, trial: str | None) -> str:
        if experiment and trial:
            return self._trial_key(experiment, trial)
        return f"{self.user}/{experiment}" if experiment else self.user


@dataclass(frozen=True)
class Skip:
    """A value that was not read: half-written, unreadable, or not to be trusted."""

    reason: str


def _server_from(sid: str, addr: str, experiment: str, trial: str, meta) -> ServerEntry | str:
    if meta is None:
        return ServerEntry(id=sid, addr=addr, experiment=experiment, trial=trial, managed=False)
    if isinstance(meta, Skip):
        return f"metadata: {meta.reason}"
    try:
        d = json.loads(meta)
        d.update(id=sid, addr=addr, experiment=experiment, trial=trial)
        return ServerEntry(**{k: v for k, v in d.items() if k in _SERVER_FIELDS})
    except (ValueError, TypeError, AttributeError):
        return "corrupt metadata"
