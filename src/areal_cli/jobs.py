"""Job records: what a running (or finished) job is, written where `ps`, `logs`, `stop` and
`doctor` find it.

    <home>/jobs/<user>/<experiment>/<trial>/job.json

The supervisor owns the record and rewrites it (atomically) as the job changes state.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from areal_cli import procs, settings
from areal_cli.errors import UsageError

STATES = ("starting", "running", "stopping", "stopped", "failed", "killed")


@dataclass
class ProcessRecord:
    role: str  # "server" | "trainer" | "supervisor"
    index: int
    pid: int
    argv: list[str]
    log: str
    addr: str | None = None  # host:port for servers
    gpus: list[int] = field(default_factory=list)
    create_time: float | None = None
    exit_code: int | None = None


@dataclass
class JobRecord:
    experiment: str
    trial: str
    kind: str  # "serve" | "train" | "serve+train"
    state: str
    marker: str
    supervisor_pid: int
    supervisor_create_time: float | None
    host: str
    started: float
    log_dir: str
    registry: str
    alloc: str | None = None
    processes: list[ProcessRecord] = field(default_factory=list)
    api_key_file: str | None = None
    message: str | None = None  # why it failed or stopped
    exit_code: int | None = None
    updated: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.experiment}/{self.trial}"

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def alive(self) -> bool:
        """The supervisor still runs (same process, not a reused pid)."""
        if self.host != settings.hostname():
            return self.state in ("starting", "running", "stopping")
        return procs.pid_alive(self.supervisor_pid, self.supervisor_create_time)

    def to_json(self) -> dict:
        d = asdict(self)
        d["name"] = self.name
        d["pids"] = self.pids
        d["alive"] = self.alive()
        return d

    @classmethod
    def from_json(cls, d: dict) -> JobRecord:
        d = dict(d)
        for k in ("name", "pids", "alive"):
            d.pop(k, None)
        d["processes"] = [ProcessRecord(**p) for p in d.get("processes", [])]
        return cls(**d)


def jobs_root(home: Path) -> Path:
    return home / "jobs" / settings.user()


def record_path(home: Path, experiment: str, trial: str) -> Path:
    return jobs_root(home) / experiment / trial / "job.json"


def write(home: Path, record: JobRecord) -> Path:
    record.updated = time.time()
    path = record_path(home, record.experiment, record.trial)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".job.json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record.to_json(), indent=2))
    os.replace(tmp, path)
    return path


def load(home: Path, experiment: str, trial: str) -> JobRecord:
    path = record_path(home, experiment, trial)
    if not path.exists():
        raise UsageError(
            f"no job {experiment}/{trial} under {jobs_root(home)}",
            hint="`areal ps` lists the jobs this home knows; --home / AREAL_HOME selects another.",
        )
    return _read(path)


def _read(path: Path) -> JobRecord:
    try:
        return JobRecord.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise UsageError(
            f"job record {path} is corrupt or half-written ({type(e).__name__})",
            hint=f"remove it if no job runs there: rm {path}",
        ) from None


def list_all(home: Path) -> tuple[list[JobRecord], list[str]]:
    """Every job record of this user, newest first, and the paths of unreadable ones."""
    records, bad = [], []
    root = jobs_root(home)
    if not root.is_dir():
        return [], []
    for path in root.glob("*/*/job.json"):
        try:
            records.append(_read(path))
        except UsageError:
            bad.append(str(path))
    records.sort(key=lambda r: r.started, reverse=True)
    return records, bad


def parse_name(name: str) -> tuple[str, str]:
    """'E/T' → (E, T); bad spellings are usage errors."""
    parts = name.strip("/").split("/")
    if len(parts) != 2 or not all(parts):
        raise UsageError(
            f"job name {name!r} is not EXPERIMENT/TRIAL",
            hint="for example: areal stop default/trial0 (see `areal ps`)",
        )
    return parts[0], parts[1]


def refuse_if_running(home: Path, experiment: str, trial: str) -> None:
    """A second job with the same experiment/trial while one is alive is refused."""
    try:
        rec = load(home, experiment, trial)
    except UsageError:
        return
    if rec.alive() and rec.state in ("starting", "running", "stopping"):
        raise UsageError(
            f"job {rec.name} is already running ({rec.kind}, supervisor pid "
            f"{rec.supervisor_pid}, started {time.strftime('%H:%M:%S', time.localtime(rec.started))})",
            hint=f"stop it first (areal stop {rec.name}) or pick another --trial",
        )
