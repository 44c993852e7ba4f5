"""Job records: what a running (or finished) job is, written where `ps`, `logs`, `stop` and
`doctor` find it.

    <home>/jobs/<user>/<experiment>/<trial>/serve.json    servers started by `areal serve`
    <home>/jobs/<user>/<experiment>/<trial>/train.json    trainers (and co-launched servers)

`serve` and `train` share an experiment/trial on purpose (that is how train finds the
servers), so each trial has one slot per kind. The supervisor owns its record and rewrites
it atomically as the job changes state.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from areal_cli import files, settings
from areal_cli.errors import UsageError
from areal_cli.plain import Plain, plain
from areal_cli.schedulers.job_records import skip_foreign, write_record

STATES = ("starting", "running", "stopping", "stopped", "failed", "killed")
LIVE = ("starting", "running", "stopping")


class ProcessRecord(Plain):
    """One process of a job."""

    __slots__ = ("role", "index", "pid", "argv", "log", "addr", "gpus", "create_time",
                 "exit_code", "server_pid", "server_create_time")  # fmt: skip

    def __init__(
        self,
        role: str,  # "server" | "trainer" | "supervisor"
        index: int,
        pid: int,
        argv: list[str],
        log: str,
        addr: str | None = None,  # host:port it listens on: a server's HTTP, torchrun's rendezvous
        gpus: list[int] | None = None,
        create_time: float | None = None,
        exit_code: int | None = None,
        # The server its replica runner registered: the one serving now, since the runner
        # starts a server that exited again (a new pid) and the supervisor follows its entry.
        server_pid: int | None = None,
        server_create_time: float | None = None,  # tells that server from a later owner of its pid
    ):
        self.role, self.index, self.pid, self.argv, self.log = role, index, pid, argv, log
        self.addr, self.gpus = addr, [] if gpus is None else gpus
        self.create_time, self.exit_code = create_time, exit_code
        self.server_pid, self.server_create_time = server_pid, server_create_time


class JobRecord(Plain):
    """A job as its supervisor records it."""

    __slots__ = ("experiment", "trial", "kind", "state", "marker", "supervisor_pid",
                 "supervisor_create_time", "host", "started", "log_dir", "registry", "alloc",
                 "model", "processes", "api_key_file", "message", "detail", "exit_code",
                 "updated", "watchdog", "restarts")  # fmt: skip

    def __init__(
        self,
        experiment: str,
        trial: str,
        kind: str,  # "serve" | "train" | "serve+train"
        state: str,
        marker: str,
        supervisor_pid: int,
        supervisor_create_time: float | None,
        host: str,
        started: float,
        log_dir: str,
        registry: str,
        alloc: str | None = None,
        model: str | None = None,  # what the servers serve, as given (a directory or a hub id)
        processes: list[ProcessRecord] | None = None,
        api_key_file: str | None = None,
        message: str | None = None,  # why it failed or stopped
        detail: str | None = None,  # the failing process's log tail
        exit_code: int | None = None,
        updated: float = 0.0,
        watchdog: dict | None = None,  # the last stall's verdict (diagnose.watchdog.Stall)
        restarts: list[dict] | None = None,  # diagnose.restart.Decision, in order
    ):
        self.experiment, self.trial, self.kind, self.state = experiment, trial, kind, state
        self.marker, self.supervisor_pid = marker, supervisor_pid
        self.supervisor_create_time, self.host, self.started = supervisor_create_time, host, started
        self.log_dir, self.registry, self.alloc, self.model = log_dir, registry, alloc, model
        self.processes = [] if processes is None else processes
        self.api_key_file, self.message, self.detail = api_key_file, message, detail
        self.exit_code, self.updated, self.watchdog = exit_code, updated, watchdog
        self.restarts = [] if restarts is None else restarts

    @property
    def name(self) -> str:
        return f"{self.experiment}/{self.trial}"

    @property
    def pids(self) -> list[int]:
        """Every process the job started that it knows of: runners and their servers."""
        return [pid for p in self.processes for pid in (p.pid, p.server_pid) if pid]

    def alive(self) -> bool:
        """The supervisor still runs (same process, not a reused pid)."""
        if self.host != settings.hostname():
            return self.state in ("starting", "running", "stopping")
        from areal_cli import procs  # psutil: only when there is a job to look at

        return procs.pid_alive(self.supervisor_pid, self.supervisor_create_time)

    def to_json(self) -> dict:
        d = plain(self)
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


def slot(kind: str) -> str:
    return "serve" if kind == "serve" else "train"


def record_path(home: Path, experiment: str, trial: str, kind: str) -> Path:
    return jobs_root(home) / experiment / trial / f"{slot(kind)}.json"


def write(home: Path, record: JobRecord) -> Path:
    record.updated = time.time()
    path = record_path(home, record.experiment, record.trial, record.kind)
    # A live job's record keeps a reserve: its final state gets written on a full disk.
    write_record(path, json.dumps(record.to_json(), indent=2), reserve=record.state in LIVE)
    return path


def load_all(home: Path, experiment: str, trial: str) -> list[JobRecord]:
    """The records of one experiment/trial (serve and/or train), live ones first; one that
    another user could have written is skipped with a warning."""
    d = jobs_root(home) / experiment / trial
    recs = [r for k in ("serve", "train") if (r := read_mine(d / f"{k}.json"))]
    recs.sort(key=lambda r: (not (r.alive() and r.state in LIVE), r.kind != "train", -r.started))
    return recs


def load(home: Path, experiment: str, trial: str, kind: str | None = None) -> JobRecord:
    """One record of E/T: of `kind` if given, else the live training job, else the live
    serving job, else the newest."""
    if kind is not None:
        recs = [r] if (r := read_mine(record_path(home, experiment, trial, kind))) else []
    else:
        recs = load_all(home, experiment, trial)
    if not recs:
        raise UsageError(
            f"no job {experiment}/{trial}"
            + (f" of kind {kind}" if kind else "")
            + f" under {jobs_root(home)}",
            hint="`areal ps --all` lists the jobs this home knows; --home / AREAL_HOME selects another.",
        )
    return recs[0]


def read(path: Path) -> JobRecord:
    """The record at `path`; files.UnsafePath (exit 2) when it is not this user's alone: its
    pids are never acted on."""
    try:
        return JobRecord.from_json(json.loads(files.read_owned(path)))
    except files.UnsafePath:
        raise
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise UsageError(
            f"job record {path} is corrupt or half-written ({type(e).__name__})",
            hint=f"remove it if no job runs there: rm {path}",
        ) from None


def read_mine(path: Path) -> JobRecord | None:
    """The record at `path`, or None when there is none or another user could have written
    it (skipped with a warning: job_records.skip_foreign)."""
    try:
        return read(path)
    except files.UnsafePath as e:
        if os.path.lexists(path):
            skip_foreign(e)
        return None
    except UsageError:
        if not os.path.lexists(path):
            return None  # gone between the look and the read
        raise


def list_all(home: Path) -> tuple[list[JobRecord], list[str]]:
    """Every job record of this user, newest first, and the paths of unreadable ones; one
    that another user could have written is skipped with a warning."""
    records, bad = [], []
    root = jobs_root(home)
    if not root.is_dir():
        return [], []
    for path in [*root.glob("*/*/serve.json"), *root.glob("*/*/train.json")]:
        try:
            rec = read_mine(path)
        except UsageError:
            bad.append(str(path))
            continue
        if rec is not None:
            records.append(rec)
    records.sort(key=lambda r: r.started, reverse=True)
    return records, bad


def lock_slot(home: Path, experiment: str, trial: str, kind: str):
    """Hold the trial's serve or train slot (the kernel drops the lock when its holder dies,
    even by SIGKILL). Two jobs racing for one slot: one gets it, the other is refused at
    once, with the holder named."""
    import fcntl

    path = record_path(home, experiment, trial, kind).with_suffix(".lock")
    settings.ensure_dir(path.parent)
    f = files.open_lock(path)  # held open as the lock; never truncated unlocked
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip()
        f.close()
        raise UsageError(
            f"another {slot(kind)} job of {experiment}/{trial} is starting or running"
            + (f" ({holder})" if holder else ""),
            hint=f"see `areal ps`, stop it (areal stop {experiment}/{trial}) or pick another --trial",
        ) from None
    _write_holder(f)
    return f


def _write_holder(f) -> None:
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()}, since {time.strftime('%H:%M:%S')}")
    f.flush()


class Claim(Plain):
    """A trial's slot(s), taken before anything of the job is written and held until it
    ends, and the job's plan file (user-only: it may hold the API key)."""

    __slots__ = ("locks", "plan_file")

    def __init__(self, locks: list, plan_file: Path):
        self.locks, self.plan_file = locks, plan_file

    @classmethod
    def take(cls, home: Path, plan) -> Claim:
        refuse_if_running(home, plan.experiment, plan.trial, plan.kind)
        kinds = ["serve", "train"] if plan.kind == "serve+train" else [plan.kind]
        locks = []
        try:
            for kind in kinds:
                locks.append(lock_slot(home, plan.experiment, plan.trial, kind))
            # Refused a second time under the lock: a job may have finished starting between.
            refuse_if_running(home, plan.experiment, plan.trial, plan.kind)
        except BaseException:
            for f in locks:
                f.close()
            raise
        job_dir = record_path(home, plan.experiment, plan.trial, plan.kind).parent
        plan_file = job_dir / f".{slot(plan.kind)}-{plan.marker}.plan.json"
        with os.fdopen(files.create_new(plan_file), "w") as f:
            json.dump(plan.to_json(redact=False), f)
        return cls(locks, plan_file)

    @classmethod
    def inherited(cls, fds: list[int], plan_file: Path) -> Claim:
        """The claim a detached supervisor got from the command that started it."""
        locks = [os.fdopen(fd, "a+") for fd in fds]
        for f in locks:
            _write_holder(f)
        return cls(locks, plan_file)

    @property
    def fds(self) -> list[int]:
        return [f.fileno() for f in self.locks]

    def handed_over(self) -> None:
        """Close this process's copies; the daemon that inherited them holds the slot."""
        for f in self.locks:
            f.close()

    def release(self) -> None:
        self.plan_file.unlink(missing_ok=True)
        for f in self.locks:
            f.close()


def refuse_if_running(home: Path, experiment: str, trial: str, kind: str) -> None:
    """One live job per slot: a serving job and a training job may share E/T, but a
    second of the same kind (or anything beside a combined serve+train job) is refused."""
    try:
        recs = load_all(home, experiment, trial)
    except UsageError:
        recs = []  # a corrupt record of a dead job does not block a new one
    for rec in recs:
        if not (rec.alive() and rec.state in LIVE):
            continue
        if slot(rec.kind) == slot(kind) or "serve+train" in (rec.kind, kind):
            raise UsageError(
                f"job {rec.name} is already running ({rec.kind}, supervisor pid "
                f"{rec.supervisor_pid}, started {time.strftime('%H:%M:%S', time.localtime(rec.started))})",
                hint=f"stop it first (areal stop {rec.name}) or pick another --trial",
            )
