"""The Ray scheduler: a job is a set of detached actors on a Ray cluster.

    planner.py  JobSpec → RayPlan: an actor per server replica (t·p GPUs, CPUs on a CPU
                cluster), a placement group with a bundle per training node; checked
                against the cluster's nodes (what none could hold: exit 2)
    actor.py    the Step actor: holds its resources, runs one runner on its node
    job.py      start, watch (placement, the runners' files, Ray's actor table), the
                outcome, the teardown (actors, group, processes by marker, registry)
    records.py  records of started jobs in AREAL_HOME
    cluster.py  connecting (RAY_ADDRESS or the option `address`; Ray's own auth), nodes,
                actor states

Each server replica runs the replica runner (launchers/replica.py) in its actor: it binds the
node's address, health-gates the server and registers it with its job and node, as on
Slurm. Training is one torchrun per bundle (launchers/torchrun.py) meeting at a port the
first node picks. The log folder and AREAL_HOME are on a filesystem every node shares, as on
Slurm. The job needs no `areal` process to run: `areal stop` ends it.

Importing this package imports no Ray: `areal ps` lists every scheduler.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from areal_cli import settings
from areal_cli.errors import UsageError
from areal_cli.schedulers.api import (
    LIVE,
    EventFn,
    Handle,
    JobStatus,
    LineFn,
    Request,
    RunOpt,
    Scheduler,
    ServerStatus,
    StopResult,
)


class RayScheduler(Scheduler):
    name = "ray"
    label = "Ray"  # "Ray job 6294eae8"
    runopts = (
        RunOpt("address", "str", "the cluster's head, HOST:PORT (default RAY_ADDRESS)"),
        RunOpt("gpus_per_node", "posint", "training ranks per node (default: world / "
               "--nnodes, else the largest node's GPUs, or CPUs without GPUs)",
               "--gpus-per-node"),
    )  # fmt: skip

    def __init__(
        self, home: Path | None = None, registry: str | None = None, address: str | None = None
    ):
        self.home = home or settings.home()
        self.registry = registry
        self.address = address
        self._stop = threading.Event()
        self._watch = None

    # -- start ----------------------------------------------------------------------------

    def dryrun(self, spec, check_packages: bool = False) -> Request:
        from areal_cli.schedulers.ray import planner

        address = getattr(spec.scheduler_opts, "address", None) or self.address
        plan = planner.plan(
            spec, self.home, self.opened_registry(), address,
            check_packages=check_packages,
        )  # fmt: skip
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
        from areal_cli.schedulers.ray import job

        plan = request.plan
        rec = job.submit(plan, self.home, request.spec.world_size)
        handle = self._handle(rec)
        watch = job.Watch(
            plan, rec, self.home, self._stop, on_event,
            on_line=None if detach else on_line, on_progress=on_progress,
        )  # fmt: skip
        self._watch = watch
        try:
            watch.until_ready()
            if detach:
                return handle
            watch.until_end()
            return handle
        except KeyboardInterrupt:
            watch._cancel("interrupted while starting")
            raise
        finally:
            watch.close()

    def request_stop(self, signum: int = 2) -> None:
        if self._watch is not None:
            self._watch.stop_code = 128 + int(signum)
        self._stop.set()

    # -- what runs ------------------------------------------------------------------------

    def find(self, experiment: str, trial: str, kind: str | None = None) -> list[Handle]:
        from areal_cli.schedulers.ray import records

        return [self._handle(r) for r in records.load(self.home, experiment, trial, kind)]

    def describe(self, handle: Handle) -> JobStatus | None:
        from areal_cli.schedulers.ray import records

        recs = records.load(self.home, handle.experiment, handle.trial, handle.kind)
        recs = [r for r in recs if handle.job_id in (None, r.job_id)]
        if not recs:
            return None
        return self._statuses(recs[:1], include_ended=True)[0]

    def list(self, include_ended: bool = False) -> list[JobStatus]:
        if not (self.home / "ray").is_dir():
            return []  # Ray never used from this home: nothing to import, nothing to ask
        from areal_cli.schedulers.ray import records

        recs = records.all_records(self.home)
        return self._statuses(recs, include_ended) if recs else []

    def _statuses(self, recs: list, include_ended: bool) -> list[JobStatus]:
        from areal_cli.schedulers.ray import job

        if any(r.live for r in recs):
            job.refresh(recs, self.home)
        return [self._status(r) for r in recs if include_ended or r.live]

    def _status(self, rec) -> JobStatus:
        servers: list[ServerStatus] = []
        ranks_alive = world = None
        state = rec.state
        if rec.live:
            from areal_cli.errors import ArealError
            from areal_cli.registry import open_registry

            try:
                reg = open_registry(rec.registry)
                entries = [e for e in reg.list(rec.experiment, rec.trial).servers
                           if e.marker == rec.marker]  # fmt: skip
                ranks = [r for r in reg.ranks(rec.experiment, rec.trial) if r.marker == rec.marker]
            except (ArealError, OSError):
                entries, ranks = [], []
            health: dict[str, bool] = {}
            paused: dict[str, bool | None] = {}
            if entries:
                from areal_cli import apikeys, control, discovery

                held = apikeys.load(rec.api_key_file) if rec.api_key_file else None
                key = held[1] if held and held[0] == rec.marker else None
                if key:
                    entries = [e for e in entries if apikeys.unproven(key, e) is None]
                health = discovery.healthy([e.addr for e in entries])
                backend = (entries[0].backend if entries else None) or "sglang"
                paused = control.paused_all([e.addr for e in entries], backend, key, 1.0)
            from areal_cli.schedulers.ray.job import ended_replicas

            ended = ended_replicas(rec)
            gone = {addr for _, addr in ended.values()}
            entries = [e for e in entries if e.addr not in gone]
            servers = [
                ServerStatus(addr=e.addr, healthy=bool(health.get(e.addr)), pid=e.pid,
                             gpus=e.gpus, node=e.node, paused=paused.get(e.addr) is True)
                for e in entries
            ]  # fmt: skip
            for i, (code, addr) in sorted(ended.items()):
                servers.append(ServerStatus(addr=addr or f"server-{i}", healthy=False,
                                            exit_code=code))  # fmt: skip
            if state == "running" and len(entries) + len(ended) < rec.replicas:
                state = "starting"
            if rec.world_size:
                ranks_alive, world = len(ranks), rec.world_size
        return JobStatus(
            handle=self._handle(rec),
            state=state,
            host=None,
            nodes=rec.nodes,
            pids=[],
            servers=servers,
            started=rec.submitted,
            log_dir=rec.log_dir,
            alloc=rec.alloc,
            model=rec.model,
            message=rec.message,
            exit_code=rec.exit_code,
            ranks_alive=ranks_alive,
            world_size=world,
            reason=rec.reason,
            marker=rec.marker,
            registry=rec.registry,
            watchdog=self._stall(rec),
        )

    def _stall(self, rec) -> dict | None:
        """The last stall the job's watchdog diagnosed (it runs in the job's first training
        actor, schedulers/ray/watch.py)."""
        from areal_cli.schedulers.ray.watch import read_stall

        return read_stall(rec.run_dir) if rec.kind != "serve" else None

    def _handle(self, rec) -> Handle:
        return Handle(self.name, rec.experiment, rec.trial, rec.kind, rec.job_id)

    def _record(self, handle: Handle):
        from areal_cli.schedulers.ray import records

        recs = records.load(self.home, handle.experiment, handle.trial, handle.kind)
        recs = [r for r in recs if handle.job_id in (None, r.job_id)]
        if not recs:
            raise UsageError(f"no Ray job {handle.name} under {records.root(self.home)}")
        return recs[0]

    def check_rows(self, registry: str) -> list:
        """`areal doctor check --scheduler ray`: the client, the cluster, its nodes, and
        whether they all see the shared files."""
        from areal_cli.schedulers.ray import check

        return check.rows(self.home, settings.registry_url(registry or self.registry),
                          self.address)  # fmt: skip

    # -- the doctor's reach --------------------------------------------------------------

    def run_on_nodes(
        self, job_id: str, commands: dict[str, list[str]], timeout: float
    ) -> dict[str, tuple[str | None, str | None]]:
        """node → (stdout, why not) of a short command (the doctor's sampler) run on each
        named node of the job at once, by the job's own actor there: no worker to start, and
        an areal module (`python -m areal_cli.X ...`) runs inside the actor, no process to
        start either (actor.run_module); it sees what the job's processes see."""
        from areal_cli.schedulers.ray import cluster, job, records

        recs = [r for r in records.all_records(self.home) if r.job_id == job_id]
        if not recs:
            raise UsageError(f"no Ray job {job_id} under {records.root(self.home)}")
        cluster.connect(recs[0].address)
        return job.run_by_actors(recs[0].actors, job_id, commands, timeout)

    # -- logs, stop -----------------------------------------------------------------------

    def log_iter(
        self,
        handle: Handle,
        role: str | None = None,
        index: int | None = None,
        follow: bool = False,
        lines: int = 50,
    ) -> Iterator[tuple[str, str]]:
        import time

        from areal_cli import logfiles

        rec = self._record(handle)
        log_dir = Path(rec.log_dir)
        if not logfiles.select_logs(log_dir, role, index) and not (follow and rec.live):
            raise UsageError(
                f"no log files for {rec.name}"
                + (f" with role {role}" if role else "")
                + f" in {rec.log_dir}",
                hint="roles: " + ", ".join(logfiles.ROLES),
            )
        follower = logfiles.Follower(log_dir, role, index, history=lines)
        checked = 0.0
        while True:
            got = False
            for item in follower.poll():
                got = True
                yield item
            if not follow:
                return
            if not got and time.monotonic() - checked > 1.0:
                checked = time.monotonic()
                self._statuses([rec], include_ended=True)
                if not rec.live:
                    yield from follower.poll()
                    return
            if not got:
                time.sleep(0.2)

    def cancel(self, handle: Handle, timeout: float = 30.0) -> StopResult:
        """Stop every runner, kill the actors, remove the group, end what is left of the job
        on each of its nodes; then no registry entry and no process of it is left."""
        from areal_cli.schedulers.ray import job

        rec = self._record(handle)
        job.refresh([rec], self.home)
        was_running = rec.state in LIVE
        if was_running:
            job.cancel(rec, self.home, timeout, job.STOPPED_BY_AREAL)
        elif os.environ.get("RAY_ADDRESS") or rec.address:
            try:  # nothing runs: still sweep what Ray may hold of it
                job.cluster.connect(rec.address)
                job.teardown(rec, self.home, grace=1.0)
            except Exception:
                pass
        deregistered = job.finish(rec, self.home)
        cancelled = f"Ray job {rec.job_id}" if was_running else None
        return StopResult(rec.name, was_running, int(was_running), deregistered, cancelled)
