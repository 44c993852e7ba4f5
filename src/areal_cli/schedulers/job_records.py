"""Where a cluster scheduler (Slurm, Ray) keeps its job records in AREAL_HOME, one layout for
all of them: `<home>/<scheduler>/<user>/<experiment>/<trial>/{serve,train}.json`, the trial's
latest serving and training job. Each scheduler has its own record type and folder, never
mixed with another's."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

from areal_cli import files, settings
from areal_cli.errors import ArealWarning, UsageError
from areal_cli.plain import Plain
from areal_cli.schedulers.api import LIVE


def write_record(path: Path, text: str, reserve: bool | None = None) -> None:
    """A job record written whole (files.write_atomic; `reserve` as there); a full disk or a
    home that cannot be written is one message."""
    try:
        files.private_dir(path.parent)  # 0700 whatever the umask, and no one else's
        files.write_atomic(path, text, reserve=reserve)
    except OSError as e:
        if files.is_full(e):
            raise files.disk_full(path, e) from None
        raise UsageError(
            f"cannot write the job record {path}: {e.strerror or e}",
            hint="pick a writable --home (or AREAL_HOME)",
        ) from None


def skip_foreign(e: files.UnsafePath) -> None:
    """A record another user could have written (theirs, writable by them, a symlink) names
    processes that are not to be acted on: one warning line, and the record is skipped."""
    warnings.warn(
        ArealWarning(f"skipped the job record {e.message}: another user could have written it"),
        stacklevel=3,
    )


def read_json(path: Path) -> dict | None:
    """A record's JSON, when it is this user's alone (files.read_owned); None when there is
    none; a foreign one is skipped with a warning (skip_foreign). Raises ValueError when it
    is not JSON."""
    try:
        return json.loads(files.read_owned(path))
    except FileNotFoundError:
        return None
    except files.UnsafePath as e:
        skip_foreign(e)
        return None


def slot(kind: str) -> str:
    """The trial's slot a job of `kind` takes: its serving job, or its training job."""
    return "serve" if kind == "serve" else "train"


class ClusterRecord(Plain):
    """What every cluster scheduler records of a job; each adds its own fields (a subclass
    naming them in its `__slots__`, its `__init__` taking them by keyword and the rest on to
    this one)."""

    __slots__ = ("experiment", "trial", "kind", "job_id", "marker", "state", "submitted",
                 "log_dir", "registry", "run_dir", "alloc", "model", "replicas", "world_size",
                 "nodes", "reason", "api_key_file", "message", "detail", "exit_code", "started",
                 "updated")  # fmt: skip

    def __init__(
        self,
        experiment: str,
        trial: str,
        kind: str,
        job_id: str,
        marker: str,
        state: str,  # our words (schedulers.api LIVE / ENDED)
        submitted: float,
        log_dir: str,
        registry: str,
        run_dir: str,
        alloc: str | None = None,
        model: str | None = None,
        replicas: int = 0,
        world_size: int = 0,
        nodes: list[str] | None = None,
        reason: str | None = None,
        api_key_file: str | None = None,
        message: str | None = None,
        detail: str | None = None,
        exit_code: int | None = None,
        started: float | None = None,
        updated: float = 0.0,
    ):
        self.experiment, self.trial, self.kind, self.job_id = experiment, trial, kind, job_id
        self.marker, self.state, self.submitted = marker, state, submitted
        self.log_dir, self.registry, self.run_dir = log_dir, registry, run_dir
        self.alloc, self.model, self.replicas, self.world_size = alloc, model, replicas, world_size
        self.nodes = [] if nodes is None else nodes
        self.reason, self.api_key_file, self.message = reason, api_key_file, message
        self.detail, self.exit_code = detail, exit_code
        self.started, self.updated = started, updated

    @property
    def name(self) -> str:
        return f"{self.experiment}/{self.trial}"

    @property
    def live(self) -> bool:
        return self.state in LIVE


class JobRecords:
    """One scheduler's records: of `record`, its ClusterRecord subclass."""

    def __init__(self, scheduler: str, record: type[ClusterRecord]):
        self.scheduler, self.record = scheduler, record

    def root(self, home: Path) -> Path:
        return home / self.scheduler / settings.user()

    def trial_dir(self, home: Path, experiment: str, trial: str) -> Path:
        """The trial's folder: its records and each start's run folder."""
        return self.root(home) / experiment / trial

    def path(self, home: Path, experiment: str, trial: str, kind: str) -> Path:
        return self.trial_dir(home, experiment, trial) / f"{slot(kind)}.json"

    def write(self, home: Path, rec: ClusterRecord) -> None:
        rec.updated = time.time()
        write_record(self.path(home, rec.experiment, rec.trial, rec.kind),
                     json.dumps(rec.to_json(), indent=2))  # fmt: skip

    def read(self, p: Path) -> ClusterRecord | None:
        try:
            d = read_json(p)
            return None if d is None else self.record(**d)
        except (OSError, ValueError, TypeError):
            return None

    def load(
        self, home: Path, experiment: str, trial: str, kind: str | None = None
    ) -> list[ClusterRecord]:
        """The trial's records (of `kind` if given), live ones first."""
        kinds = [kind] if kind else ["serve", "train"]
        recs = [r for k in kinds if (r := self.read(self.path(home, experiment, trial, k)))]
        recs.sort(key=lambda r: (not r.live, r.kind == "serve", -r.submitted))
        return recs

    def all_records(self, home: Path) -> list[ClusterRecord]:
        """Every record of this user; an empty list, fast, when the scheduler was never used
        here."""
        base = self.root(home)
        if not base.is_dir():
            return []
        found = (self.read(p) for p in [*base.glob("*/*/serve.json"), *base.glob("*/*/train.json")])
        return sorted((r for r in found if r is not None), key=lambda r: r.submitted, reverse=True)
