"""The local scheduler: jobs as processes on this host.

    planner.py     JobSpec → Plan (GPUs, ports, argv, env, logs), checked before anything runs
    supervisor.py  runs a plan: replica and torchrun runners, readiness, watch, teardown
    launch.py      detached jobs: the supervisor as a daemon, waited on until ready
    reaper.py      the watchdog that tears a job down when its supervisor dies
    records.py     job records in AREAL_HOME, and the trial's slots
    submit.py      dryrun and schedule: the planner, launch or the supervisor
    live.py        what `areal ps` asks of a live job's servers and registry
    stop.py        `areal stop`, and the watchdog's teardown

The package itself imports only what listing records needs (`areal ps`); each of submit.py,
live.py and stop.py is imported at its one point of use.

Nothing outside this package reaches into these modules; commands use the Scheduler API.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

from areal_cli import settings
from areal_cli.schedulers.api import (
    Handle,
    JobStatus,
    Request,
    Scheduler,
    ServerStatus,
    StopResult,
)
from areal_cli.schedulers.local import records

# typing's TYPE_CHECKING without importing typing (5 ms of `areal ps`).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from areal_cli.spec import JobSpec


class LocalScheduler(Scheduler):
    name = "local"
    records = "jobs"

    def __init__(self, home: Path | None = None, registry: str | None = None):
        self.home = home or settings.home()
        self.registry = registry
        self._foreground = None
        # Registries that did not answer during this command (url → why): asked once only, so
        # a stop of several jobs costs one request timeout per registry, not one per job.
        self._unanswered: dict[str, str] = {}

    # -- submit ---------------------------------------------------------------------------

    def dryrun(self, spec: JobSpec, check_packages: bool = False) -> Request:
        from areal_cli.schedulers.local import submit  # the planner: not at `areal ps`

        return submit.dryrun(self, spec, check_packages)

    def schedule(self, request: Request, *, detach: bool, **callbacks) -> Handle:
        """Scheduler.schedule; `callbacks`: on_event, on_line, on_progress."""
        from areal_cli.schedulers.local import submit  # the supervisor: not at `areal ps`

        return submit.schedule(self, request, detach, callbacks)

    def request_stop(self, signum: int = signal.SIGINT) -> None:
        if self._foreground is not None:
            from areal_cli.schedulers.local import submit  # imported already: it started the job

            submit.request_stop(self._foreground, signum)

    # -- what runs ------------------------------------------------------------------------

    def find(self, experiment: str, trial: str, kind: str | None = None) -> list[Handle]:
        if kind is not None:
            path = records.record_path(self.home, experiment, trial, kind)
            recs = [records.read(path)] if path.exists() else []
        else:
            recs = records.load_all(self.home, experiment, trial)
        return [self._handle(r) for r in recs]

    def describe(self, handle: Handle) -> JobStatus | None:
        path = records.record_path(self.home, handle.experiment, handle.trial, handle.kind)
        if not path.exists():
            return None
        return self._statuses([records.read(path)], include_ended=True)[0]

    def describe_ready(self, handle: Handle) -> JobStatus | None:
        path = records.record_path(self.home, handle.experiment, handle.trial, handle.kind)
        if not path.exists():
            return None
        return self._statuses([records.read(path)], include_ended=True, probe=False)[0]

    def list(self, include_ended: bool = False) -> list[JobStatus]:
        recs, bad = records.list_all(self.home)
        out = self._statuses(recs, include_ended)
        for path in bad:
            out.append(
                JobStatus(
                    Handle(self.name, path, "", "?"), "corrupt", message="unreadable job record"
                )
            )
        return out

    def _statuses(
        self, recs: list[records.JobRecord], include_ended: bool, probe: bool = True
    ) -> list[JobStatus]:
        """probe=False: a server its runner registered (the supervisor then recorded its
        pid) counts as healthy and not paused, unasked."""
        rows = []
        for rec in recs:
            state = rec.state
            if state in records.LIVE and not rec.alive():
                state = "dead"  # supervisor and watchdog both gone without a word
            if include_ended or state in records.LIVE:
                rows.append((rec, state))
        if not rows:
            return []
        health: dict[str, bool] = {}
        paused: dict[str, bool] = {}
        ranks: dict[str, tuple[int, int]] = {}
        entries: dict = {}
        if any(state in records.LIVE for _, state in rows):
            # Threads, http.client and the registry: only to ask live jobs.
            from areal_cli.schedulers.local import live

            health, paused, ranks, entries = live.probe(rows, probe, self._unanswered)
        out = []
        for rec, state in rows:
            servers = [
                ServerStatus(
                    addr=p.addr, healthy=bool(health.get(p.addr)),
                    # The entry's pid is the freshest: the supervisor's record follows a
                    # restarted server's within a second (supervisor._follow_servers).
                    pid=getattr(entries.get(p.addr), "pid", None) or p.server_pid or p.pid,
                    gpus=p.gpus, node=rec.host, exit_code=p.exit_code,
                    paused=paused.get(p.addr, False),
                    errors=getattr(entries.get(p.addr), "errors", None),
                    restarts=getattr(entries.get(p.addr), "restarts", 0),
                )
                for p in rec.processes
                if p.role == "server" and p.addr
            ]  # fmt: skip
            out.append(
                JobStatus.of_record(
                    self._handle(rec),
                    state,
                    rec,
                    host=rec.host,
                    nodes=[rec.host],
                    pids=[rec.supervisor_pid, *rec.pids],
                    servers=servers,
                    started=rec.started,
                    watchdog=rec.watchdog,
                    restarts=rec.restarts,
                    ranks_alive=ranks.get(rec.marker, (None, None))[0],
                    world_size=ranks.get(rec.marker, (None, None))[1],
                )
            )
        return out

    def _handle(self, rec: records.JobRecord) -> Handle:
        return Handle(self.name, rec.experiment, rec.trial, rec.kind)

    # -- logs, stop -----------------------------------------------------------------------

    def log_files(self, handle: Handle) -> tuple[str, Path, Callable[[], bool], float]:
        rec = self._record(handle)

        def live() -> bool:
            return any(r.alive() and r.state in records.LIVE
                       for r in records.load_all(self.home, rec.experiment, rec.trial))  # fmt: skip

        return rec.name, Path(rec.log_dir), live, 0.0

    def cancel(self, handle: Handle, timeout: float = 30.0) -> StopResult:
        """SIGTERM the supervisor and wait; then make sure nothing of the job is left, and
        nothing of the trial's other job if that one is not running either."""
        from areal_cli.schedulers.local import stop  # psutil: `ps` with no jobs never needs it

        return stop.cancel(self, handle, timeout)

    def _record(self, handle: Handle) -> records.JobRecord:
        return records.load(self.home, handle.experiment, handle.trial, handle.kind)
