"""The local scheduler: jobs as processes on this host.

    planner.py     JobSpec → Plan (GPUs, ports, argv, env, logs), checked before anything runs
    supervisor.py  runs a plan: replica and torchrun runners, readiness, watch, teardown
    launch.py      detached jobs: the supervisor as a daemon, waited on until ready
    reaper.py      the watchdog that tears a job down when its supervisor dies
    records.py     job records in AREAL_HOME, and the trial's slots

Nothing outside this package reaches into these modules; commands use the Scheduler API.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from areal_cli import logfiles, settings
from areal_cli.errors import UsageError
from areal_cli.schedulers.api import (
    EventFn,
    Handle,
    JobStatus,
    LineFn,
    Request,
    Scheduler,
    ServerStatus,
    Stopped,
    StopResult,
)
from areal_cli.schedulers.local import records

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
        from areal_cli.schedulers.local import planner

        plan = planner.plan(spec, self.home, self.opened_registry(), check_packages=check_packages)
        return Request(self.name, spec, plan)

    def schedule(
        self,
        request: Request,
        *,
        detach: bool,
        on_event: EventFn | None = None,
        on_line: LineFn | None = None,
        on_progress: Callable[[str], None] | None = None,
    ) -> Handle:
        plan = request.plan
        if plan.servers:
            _check_registry(plan.registry)
        claim = records.Claim.take(self.home, plan)
        handle = Handle(self.name, plan.experiment, plan.trial, plan.kind)
        if detach:
            from areal_cli.schedulers.local import launch

            try:
                daemon = launch.spawn_detached(plan, self.home, claim)
            except BaseException:
                claim.release()
                raise
            claim.handed_over()
            n = len(plan.servers)

            def progress(rec) -> None:
                if on_progress and rec is not None and rec.marker == plan.marker:
                    on_progress(f"{rec.state}, {len(rec.processes)}/{n} spawned")

            try:
                launch.wait_detached(plan, self.home, daemon, progress)
            except KeyboardInterrupt:
                # Ctrl-C while waiting means "never mind": the starting job goes too.
                daemon.terminate()
                daemon.wait()
                raise
            return handle
        from areal_cli.schedulers.local.supervisor import Supervisor

        sup = Supervisor(
            plan, self.home, claim, on_event=on_event, on_line=on_line,
            registry=self.opened_registry(),
        )  # fmt: skip
        self._foreground = sup
        code = sup.run()
        if code:
            raise Stopped(code)
        return handle

    def request_stop(self, signum: int = signal.SIGINT) -> None:
        from areal_cli.schedulers.local.supervisor import EXIT_TERMINATED

        if self._foreground is not None:
            if signum == signal.SIGINT:
                self._foreground.request_stop("interrupted")
            else:
                self._foreground.request_stop("terminated", EXIT_TERMINATED)

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
        here = settings.hostname()
        probes = [
            p.addr
            for rec, state in rows
            for p in rec.processes
            if p.role == "server" and p.addr and rec.host == here and state in records.LIVE
        ]
        health: dict[str, bool] = {}
        paused: dict[str, bool] = {}
        if not probe:
            health = {p.addr: True for rec, _ in rows for p in rec.processes
                      if p.role == "server" and p.addr in probes and p.server_pid}  # fmt: skip
        elif probes:
            from concurrent.futures import ThreadPoolExecutor

            from areal_cli import discovery  # threads and http.client: only to probe servers

            with ThreadPoolExecutor(max_workers=1) as ex:
                asked = ex.submit(_paused_servers, rows, here)
                health = discovery.healthy(probes)
                paused = asked.result()
        out = []
        ranks = _live_ranks([rec for rec, state in rows if state in records.LIVE],
                            self._unanswered)  # fmt: skip
        entries = _server_entries([rec for rec, state in rows if state in records.LIVE],
                                  self._unanswered)  # fmt: skip
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
                JobStatus(
                    handle=self._handle(rec),
                    state=state,
                    host=rec.host,
                    nodes=[rec.host],
                    pids=[rec.supervisor_pid, *rec.pids],
                    servers=servers,
                    started=rec.started,
                    log_dir=rec.log_dir,
                    alloc=rec.alloc,
                    model=rec.model,
                    message=rec.message,
                    exit_code=rec.exit_code,
                    marker=rec.marker,
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

    def log_iter(
        self,
        handle: Handle,
        role: str | None = None,
        index: int | None = None,
        follow: bool = False,
        lines: int = 50,
    ) -> Iterator[tuple[str, str]]:
        rec = self._record(handle)

        def live() -> bool:
            return any(r.alive() and r.state in records.LIVE
                       for r in records.load_all(self.home, rec.experiment, rec.trial))  # fmt: skip

        return logfiles.job_lines(rec.name, Path(rec.log_dir), role, index, follow=follow,
                                  lines=lines, live=live)  # fmt: skip

    def cancel(self, handle: Handle, timeout: float = 30.0) -> StopResult:
        """SIGTERM the supervisor and wait; then make sure nothing of the job is left, and
        nothing of the trial's other job if that one is not running either."""
        from areal_cli import procs  # psutil: `ps` with no jobs never needs it

        rec = self._record(handle)
        if rec.host != settings.hostname():
            # Its pids mean nothing here (a shared home seen from another node).
            raise UsageError(
                f"job {rec.name} runs on {rec.host}, not on this host ({settings.hostname()})",
                hint=f"run `areal stop {rec.name}` on {rec.host}",
            )
        was_running = rec.alive() and rec.state in records.LIVE
        if was_running:
            try:
                os.kill(rec.supervisor_pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            except PermissionError:
                # Another user's process holds the pid now: ours, which ran as us, is gone.
                was_running = False
            if was_running:
                procs.wait_until(lambda: not rec.alive(), timeout)
        # Only pids that are still the processes we started: an old record's pids may be reused.
        roots = [p.pid for p in rec.processes if procs.pid_alive(p.pid, p.create_time)]
        # And the servers now serving (a runner's restart changes the pid; a server whose
        # runner was killed is in no runner's tree): those with a create time to check it by.
        roots += [p.server_pid for p in rec.processes if p.server_pid and p.server_create_time
                  and procs.pid_alive(p.server_pid, p.server_create_time)]  # fmt: skip
        killed = procs.kill_job(rec.marker, roots, grace=3.0)
        left: list[str] = []
        alive = sorted({p.pid for p in procs.find_marked(rec.marker)}
                       | {pid for pid in roots if procs.pid_alive(pid)})  # fmt: skip
        if alive:
            left.append(f"{len(alive)} process(es) still alive after SIGKILL: "
                        + " ".join(map(str, alive)))  # fmt: skip
        if was_running and rec.alive():
            alive.append(rec.supervisor_pid)
            left.append(f"its supervisor (pid {rec.supervisor_pid}) did not stop within "
                        f"{timeout:g}s")  # fmt: skip
        deregistered = 0
        for url in dict.fromkeys([rec.registry, settings.registry_url(self.registry)]):
            got = self._deregister(url, rec, servers_gone=not alive)
            if isinstance(got, str):
                left.append(got)
            else:
                deregistered += got
        fresh = records.load(self.home, rec.experiment, rec.trial, rec.kind)
        if fresh.state in records.LIVE:
            fresh.state = "stopped"
            fresh.message = "stopped by areal stop"
            records.write(self.home, fresh)
        elif was_running and fresh.message == "terminated":
            # A foreground job knows only that a SIGTERM came: it was ours.
            fresh.message = "stopped by areal stop"
            records.write(self.home, fresh)
        return StopResult(rec.name, was_running, killed, deregistered, left=left,
                          running=bool(alive))  # fmt: skip

    def _deregister(self, url: str, rec: records.JobRecord, servers_gone: bool) -> int | str:
        """The job's entries removed from one registry: how many, or what was left and why."""
        from areal_cli.errors import ArealError, WaitTimeout
        from areal_cli.registry import open_registry, registry_class

        fate = registry_class(url).leftovers_expire or (
            "readers skip such entries: their servers are gone"
            if servers_gone
            else "readers skip such entries once their heartbeat is older than the TTL"
        )
        why = self._unanswered.get(url)
        if why is None:
            reg = open_registry(url)
            try:
                return reg.deregister_job(rec.experiment, rec.trial, rec.marker)
            except (ArealError, OSError) as e:
                why = getattr(e, "message", None) or getattr(e, "strerror", None) or str(e)
                if isinstance(e, WaitTimeout):
                    self._unanswered[url] = why
                else:
                    try:
                        listed = reg.list(rec.experiment, rec.trial, include_dead=True).servers
                        n = sum(x.marker == rec.marker for x in listed)
                    except (ArealError, OSError):
                        n = None
                    if n == 0:
                        return 0
                    if n is not None:
                        return f"{n} registry entr{'y' if n == 1 else 'ies'} left in {url} " \
                               f"({why}); {fate}"  # fmt: skip
        return f"the job's registry entries in {url} were not removed ({why}); {fate}"

    def _record(self, handle: Handle) -> records.JobRecord:
        return records.load(self.home, handle.experiment, handle.trial, handle.kind)


def _paused_servers(rows: list, here: str) -> dict[str, bool]:
    """addr → paused, for the live servers of these jobs that registered once (a server still
    loading is not ready either, and not paused)."""
    from areal_cli import apikeys, control

    asks = []
    for rec, state in rows:
        if rec.host != here or state not in records.LIVE:
            continue
        held = apikeys.load(rec.api_key_file) if rec.api_key_file else None
        key = held[1] if held and held[0] == rec.marker else None
        for p in rec.processes:
            backend = control.backend_of(p.argv)
            if p.role == "server" and p.addr and p.server_pid and backend:
                asks.append((p.addr, backend, key))
    if not asks:
        return {}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(32, len(asks))) as ex:
        got = ex.map(lambda a: control.paused(a[0], a[1], a[2], timeout=1.0), asks)
        return {a[0]: flag is True for a, flag in zip(asks, got, strict=True)}


def _server_entries(recs: list, unanswered: dict[str, str]) -> dict:
    """addr → its registry entry, where its runner puts the requests it answered with
    errors lately (areal_cli.request_errors) and its restarts; the job's own (its marker)."""
    from areal_cli.errors import ArealError, WaitTimeout
    from areal_cli.registry import open_registry

    out: dict[str, dict] = {}
    for rec in recs:
        if rec.registry in unanswered or not any(p.role == "server" for p in rec.processes):
            continue
        try:
            entries = open_registry(rec.registry).list(rec.experiment, rec.trial).servers
        except WaitTimeout as e:
            unanswered[rec.registry] = e.message
            continue
        except (ArealError, OSError):
            continue
        out.update({e.addr: e for e in entries if e.marker == rec.marker})
    return out


def _live_ranks(
    recs: list[records.JobRecord], unanswered: dict[str, str]
) -> dict[str, tuple[int, int]]:
    """marker → (ranks alive, world size) from the registry's rank table, per training job.
    A registry that does not answer is noted in `unanswered` and not asked again."""
    if not any(rec.kind != "serve" for rec in recs):
        return {}
    from areal_cli.errors import ArealError, WaitTimeout
    from areal_cli.parallel import ParallelDims
    from areal_cli.registry import open_registry

    out: dict[str, tuple[int, int]] = {}
    for rec in recs:
        if rec.kind == "serve" or rec.registry in unanswered:
            continue
        try:
            world = ParallelDims.from_alloc(rec.alloc).world_size if rec.alloc else 0
            alive = [r for r in open_registry(rec.registry).ranks(rec.experiment, rec.trial)
                     if r.marker == rec.marker]  # fmt: skip
        except WaitTimeout as e:
            unanswered[rec.registry] = e.message
            continue
        except (ArealError, OSError):
            continue
        out[rec.marker] = (len(alive), alive[0].world_size if alive else world)
    return out


def _check_registry(url: str) -> None:
    """Servers are only useful once registered: a registry we cannot write (another user's
    folder, a read-only path, etcd refusing us) is a usage error before anything starts."""
    from areal_cli.registry import open_registry

    try:
        open_registry(url).probe()
    except OSError as e:
        raise UsageError(
            f"cannot write the registry at {url}: {e.strerror or e}",
            hint="pick a writable --registry (or AREAL_REGISTRY)",
        ) from None
