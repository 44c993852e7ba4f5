"""What the schedulers whose jobs run on a cluster (Slurm, Ray) do the same way, in TorchX's
manner: one ClusterScheduler plans and starts a job, finds, describes and lists jobs from their
records, and asks a foreground one to stop. What differs is a small hook each (the planner's
own arguments, how records are brought up to date, the replicas' rows in `areal ps`, the last
stall of a job's watchdog), beside what is wholly a scheduler's own: cancel, logs, the doctor's
reach of its nodes, its `doctor check` rows.

A cluster scheduler is a package with three modules this base imports when it needs them:

    planner.py  plan(spec, home, registry, check_packages=..., **options) → its Plan
    job.py      submit(plan, home, world_size) → record; follow(plan, rec, home, stop, ...)
                → the job's lifecycle.Lifecycle over its Transport; refresh(recs, home)
    records.py  its JobRecords' load, all_records, root (job_records.py)

Below it, what those job modules share: the new run folder and its private files, the fields
of a new record, the slot lock and the refusal of a second job in a slot, a runner's exit code,
the replicas that ended, following a job's logs (schedulers/lifecycle.py follows one job over
each scheduler's transport). What asks a live job's servers, takes them out of discovery and
leaves nothing of an ended job behind is cluster_live.py, imported only for a live or an
ending job.

Importing this module imports no scheduler's package and nothing heavy: `areal ps` lists every
one.
"""

from __future__ import annotations

import importlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from areal_cli import files, logfiles, settings
from areal_cli.errors import UsageError
from areal_cli.schedulers.api import (
    EventFn,
    Handle,
    JobStatus,
    LineFn,
    Request,
    Scheduler,
    ServerStatus,
)
from areal_cli.schedulers.job_records import slot


class ClusterScheduler(Scheduler):
    reaches_nodes = True

    def __init__(self, home: Path | None = None, registry: str | None = None):
        self.home = home or settings.home()
        self.registry = registry
        self._stop = threading.Event()
        self._watch = None

    def _module(self, name: str):
        """Its package's planner, job or records module, imported now (not at `areal ps`)."""
        return importlib.import_module(f"{type(self).__module__}.{name}")

    # -- hooks ----------------------------------------------------------------------------

    def _plan_options(self, spec) -> dict:
        """What its planner takes beyond the spec, the home and the registry."""
        return {}

    def _submitted(self, rec, on_event: EventFn | None) -> None:
        """Tell the command the job is submitted (what it is called on the cluster)."""
        if on_event:
            on_event("submitted", {"what": f"{self.label} job {rec.job_id}", "job_id": rec.job_id})

    def _refresh(self, recs: list) -> None:
        """Bring live records up to date with the cluster."""
        self._module("job").refresh(recs, self.home)

    def _replica_rows(
        self, rec, entries: list, ended: dict, health: dict, paused: dict
    ) -> tuple[list[ServerStatus], int]:
        """The rows of a live job's replicas in `areal ps`, in replica order: its registered
        servers; those that registered once but are out of discovery now (a runner takes its
        server out while it does not answer, and while it starts it again), unhealthy; then
        the ended ones. And how many replicas have shown up (registered once, or ended):
        fewer than the job's, it is still starting."""
        order = replica_order(rec)
        entries = sorted(entries, key=lambda e: order.get(e.addr, len(order)))
        rows = [server_row(e, health, paused) for e in entries]
        listed = {e.addr for e in entries}
        gone = {addr for _, addr in ended.values()}
        rows += [ServerStatus(addr=addr, healthy=False) for addr in sorted(order, key=order.get)
                 if addr not in listed and addr not in gone]  # fmt: skip
        rows += ended_rows(ended)  # a replica's runner ended (`scancel J.S`, a crash, ray kill)
        if ended:
            from areal_cli.schedulers.common import describe_exit

            rec.reason = "; ".join(
                f"server-{i} ended ({describe_exit(code)})" for i, (code, _) in ended.items()
            )
        return rows, len(set(order.values()) | set(ended))

    def _stall(self, rec) -> dict | None:
        """The last stall the job's watchdog diagnosed (its verdict, bundle), if it keeps one."""
        return None

    # -- start ----------------------------------------------------------------------------

    def dryrun(self, spec, check_packages: bool = False) -> Request:
        plan = self._module("planner").plan(
            spec, self.home, self.opened_registry(), check_packages=check_packages,
            **self._plan_options(spec),
        )  # fmt: skip
        return Request(self.name, spec, plan)

    def schedule(self, request: Request, *, detach: bool, **callbacks) -> Handle:
        """Scheduler.schedule; `callbacks`: on_event, on_line, on_progress."""
        job = self._module("job")
        plan = request.plan
        on_event = callbacks.get("on_event")
        rec = job.submit(plan, self.home, request.spec.world_size)
        handle = self._handle(rec)
        self._submitted(rec, on_event)
        watch = job.follow(
            plan, rec, self.home, self._stop, on_event,
            on_line=None if detach else callbacks.get("on_line"),
            on_progress=callbacks.get("on_progress"),
        )  # fmt: skip
        self._watch = watch
        try:
            watch.until_ready()
            if not detach:
                watch.until_end()
            return handle
        except KeyboardInterrupt:
            # Ctrl-C while a detached start waits means "never mind": the job goes too.
            watch.cancel("interrupted while starting")
            raise
        finally:
            watch.close()

    def request_stop(self, signum: int = 2) -> None:
        if self._watch is not None:
            self._watch.stop_code = 128 + int(signum)
        self._stop.set()

    # -- what runs ------------------------------------------------------------------------

    def _records(self, experiment: str, trial: str, kind: str | None, job_id: str | None):
        recs = self._module("records").load(self.home, experiment, trial, kind)
        return [r for r in recs if job_id in (None, r.job_id)]

    def find(self, experiment: str, trial: str, kind: str | None = None) -> list[Handle]:
        return [self._handle(r) for r in self._records(experiment, trial, kind, None)]

    def describe(self, handle: Handle) -> JobStatus | None:
        recs = self._records(handle.experiment, handle.trial, handle.kind, handle.job_id)
        return self._statuses(recs[:1], include_ended=True)[0] if recs else None

    def list(self, include_ended: bool = False) -> list[JobStatus]:
        if not (self.home / self.name).is_dir():
            return []  # never used from this home: nothing to import, nothing to ask
        recs = self._module("records").all_records(self.home)
        return self._statuses(recs, include_ended) if recs else []

    def _statuses(self, recs: list, include_ended: bool) -> list[JobStatus]:
        if any(r.live for r in recs):
            self._refresh(recs)
        return [self._status(r) for r in recs if include_ended or r.live]

    def _status(self, rec) -> JobStatus:
        servers: list[ServerStatus] = []
        ranks_alive = world = None
        state = rec.state
        if rec.live:
            # Threads and http.client: only for a live job (see cluster_live.py).
            from areal_cli.schedulers import cluster_live

            entries, ranks, health, paused = cluster_live.registered(rec)
            ended = ended_replicas(rec)
            gone = {addr for _, addr in ended.values()}
            entries = [e for e in entries if e.addr not in gone]
            servers, shown = self._replica_rows(rec, entries, ended, health, paused)
            if state == "running" and shown < rec.replicas:
                state = "starting"  # a replica neither registered nor ended yet
            if rec.world_size:
                ranks_alive, world = len(ranks), rec.world_size
        return JobStatus.of_record(
            self._handle(rec),
            state,
            rec,
            nodes=rec.nodes,
            started=rec.submitted,
            reason=rec.reason,
            registry=rec.registry,
            servers=servers,
            ranks_alive=ranks_alive,
            world_size=world,
            watchdog=self._stall(rec),
            restarts=_restarts(rec),
        )

    def _handle(self, rec) -> Handle:
        return Handle(self.name, rec.experiment, rec.trial, rec.kind, rec.job_id)

    def _record(self, handle: Handle):
        recs = self._records(handle.experiment, handle.trial, handle.kind, handle.job_id)
        if not recs:
            root = self._module("records").root(self.home)
            raise UsageError(f"no {self.label} job {handle.name} under {root}")
        return recs[0]

    # -- logs -----------------------------------------------------------------------------

    def log_files(self, handle: Handle) -> tuple[str, Path, Callable[[], bool], float]:
        """The job's log files on the shared filesystem; following ends when the job does."""
        rec = self._record(handle)

        def live() -> bool:
            self._statuses([rec], include_ended=True)
            return rec.live

        return rec.name, Path(rec.log_dir), live, 1.0


def replica_order(rec) -> dict[str, int]:
    """addr → replica index, from the ready files the replica runners leave in the run folder
    (the registry does not know which replica a server is)."""
    out = {}
    for path in Path(rec.run_dir).glob("server-*.ready"):
        try:
            out[json.loads(path.read_text())["addr"]] = int(path.stem.split("-")[1])
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return out


def server_row(e, health: dict, paused: dict) -> ServerStatus:
    """A registered server's row in `areal ps`."""
    return ServerStatus(addr=e.addr, healthy=bool(health.get(e.addr)), pid=e.pid, gpus=e.gpus,
                        node=e.node, paused=paused.get(e.addr) is True,
                        errors=e.errors, restarts=e.restarts)  # fmt: skip


def ended_rows(ended: dict[int, tuple[int, str | None]]) -> list[ServerStatus]:
    """A replica whose runner ended while the job runs on is listed dead, with its code."""
    return [ServerStatus(addr=addr or f"server-{i}", healthy=False, exit_code=code)
            for i, (code, addr) in sorted(ended.items())]  # fmt: skip


# -- what the job modules share ------------------------------------------------------------


def private_file(path: Path, text: str) -> None:
    """A file only its owner reads (the plan holds the API key), created afresh."""
    with os.fdopen(files.create_new(path), "w") as f:
        f.write(text)


def new_run_folder(plan, plan_file: str, env_file: str) -> Path:
    """The job's run folder, made afresh (0700): its plan, secrets included, in `plan_file`,
    the trainers' environment in `env_file`, and its servers' API key stored. Nothing of it
    is left when a step fails."""
    # Only when a job starts, not at `areal ps`.
    import shutil

    from areal_cli import apikeys

    run = Path(plan.run_dir)
    settings.ensure_dir(plan.log_dir)
    settings.ensure_dir(run.parent)
    run.mkdir(mode=0o700)
    try:
        private_file(run / plan_file, json.dumps(plan.to_json(redact=False)))
        for p in plan.trainers:
            private_file(run / env_file, json.dumps(p.env))
        if plan.api_key and plan.api_key_file and plan.servers:
            apikeys.store(plan.api_key_file, plan.marker, plan.api_key)
    except BaseException:
        shutil.rmtree(run, ignore_errors=True)
        raise
    return run


def record_fields(plan, world_size: int) -> dict:
    """What the record of every cluster job (job_records.ClusterRecord) takes from its plan
    when it is submitted; each scheduler adds its own fields."""
    return dict(
        experiment=plan.experiment, trial=plan.trial, kind=plan.kind, marker=plan.marker,
        state="pending", submitted=time.time(), log_dir=plan.log_dir, registry=plan.registry,
        run_dir=plan.run_dir, alloc=plan.alloc, model=plan.model_path,
        replicas=len(plan.servers), world_size=world_size, api_key_file=plan.api_key_file,
    )  # fmt: skip


def drop_old_runs(previous: list, rec) -> None:
    """The run folders of the slot's earlier jobs that ended, once `rec` took their place:
    each start makes a new one."""
    import shutil  # only when a job starts

    for old in previous:
        if not old.live and old.run_dir != rec.run_dir:
            shutil.rmtree(old.run_dir, ignore_errors=True)


class SlotLock:
    """Held while a trial's serve or train slot is checked and its job started: two starts at
    once, one refused. `jobs_dir`: the scheduler's folder of the trial; `verb`: "submitted",
    "started"."""

    def __init__(self, jobs_dir: Path, plan, verb: str):
        self.path = jobs_dir / f".{slot(plan.kind)}.lock"
        self.plan, self.verb = plan, verb

    def __enter__(self):
        import fcntl

        settings.ensure_dir(self.path.parent)
        self.f = files.open_lock(self.path)  # the lock lives as long as the file
        try:
            fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.f.close()
            raise UsageError(
                f"another {slot(self.plan.kind)} job of {self.plan.experiment}/"
                f"{self.plan.trial} is being {self.verb} right now",
                hint="see `areal ps`, or pick another --trial",
            ) from None
        return self

    def __exit__(self, *exc):
        self.f.close()


def clash(plan, kind: str) -> bool:
    """Whether a live job of `kind` in the plan's trial takes the slot the plan needs (a
    serving and a training job may share a trial; a second of the same kind may not)."""
    return slot(kind) == slot(plan.kind) or "serve+train" in (kind, plan.kind)


def refusal(plan, kind: str, what: str) -> UsageError:
    return UsageError(
        f"job {plan.experiment}/{plan.trial} is already running ({kind}, {what})",
        hint=f"stop it first (areal stop {plan.experiment}/{plan.trial}) or pick another --trial",
    )


def read_code(path: Path) -> int | None:
    """The exit code a runner left in its `.exit` file, or None while it runs."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def reread(recs: list, records, home: Path) -> None:
    """Each record as it is on disk now: another areal (a stop, a follower) may have written
    it since it was read."""
    for rec in recs:
        fresh = records.read(records.path(home, rec.experiment, rec.trial, rec.kind))
        if fresh is not None and fresh.job_id == rec.job_id:
            for field in fresh._fields:  # a record's fields are its slots (plain.Plain)
                setattr(rec, field, getattr(fresh, field))


def ended_replicas(rec) -> dict[int, tuple[int, str | None]]:
    """Replicas whose runner ended while the job runs on (a step cancelled, a crash): index →
    (exit code, the address it had registered, if it had)."""
    out = {}
    run = Path(rec.run_dir)
    for i in range(rec.replicas):
        code = read_code(run / f"server-{i}.exit")
        if code is None:
            continue
        out[i] = (code, ready_addr(rec, i))
    return out


def ready_addr(rec, index: int) -> str | None:
    """The address replica `index` registered, from the file its runner left once ready."""
    try:
        return json.loads((Path(rec.run_dir) / f"server-{index}.ready").read_text())["addr"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def follow_logs(plan, on_line: LineFn, stop: threading.Event, trainer_roles: tuple[str, ...]):
    """Feed the job's new log lines to `on_line` until `stop`: its own roles only (a training
    job's terminal shows no serving job's lines), and of files that already exist only what the
    job writes (it starts them afresh)."""
    roles = (("server",) if plan.servers else ()) + (trainer_roles if plan.trainers else ())
    follower = logfiles.Follower(Path(plan.log_dir), history=None, roles=roles)
    for label, path in logfiles.select_logs(Path(plan.log_dir)).items():
        try:
            follower.offsets[label] = path.stat().st_size
        except OSError:
            pass

    def loop() -> None:
        while True:
            stopping = stop.wait(0.05)
            for label, line in follower.poll():
                on_line(label, line)
            if stopping:
                return

    t = threading.Thread(target=loop, name="log-follower", daemon=True)
    t.start()
    return t


def _restarts(rec) -> list[dict]:
    """The trainers' restarts and refusals that the job's batch side logged in its run folder
    (areal train --max-restarts)."""
    from areal_cli.diagnose import restart  # dataclasses: only once a cluster job is listed

    return restart.read_log(getattr(rec, "run_dir", None))
