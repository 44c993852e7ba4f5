"""The Slurm scheduler: a job is one batch job on a Slurm cluster.

    planner.py  JobSpec → SlurmPlan: nodes, GPUs, steps, checked against the partition
    script.py   the batch script (what --dry-run prints)
    job.py      submit, watch (squeue, the runners' files), the outcome, the cleanup
    records.py  records of submitted jobs in AREAL_HOME
    cluster.py  sbatch, squeue --json, scancel, sinfo, scontrol

Each server replica is a job step running the replica runner (launchers/replica.py) on its
node: it binds the node's address, health-gates the server and registers it with its Slurm job,
step and node. Training is one step with a torchrun per node (launchers/torchrun.py). The
batch job needs no `areal` process to run: `areal` submits and watches it, and `areal stop`
cancels it. Logs are files in the trial's folder on the shared filesystem.

Importing this package runs no Slurm command: `areal ps` lists every scheduler.
"""

from __future__ import annotations

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


class SlurmScheduler(Scheduler):
    name = "slurm"
    label = "Slurm"  # "Slurm job 58"
    killed_by = "Slurm preemption"  # PREEMPTED: the only way Slurm kills a job of ours
    runopts = (
        RunOpt("partition", "str", "Slurm partition (default: the cluster's)", "--partition"),
        RunOpt("account", "str", "Slurm account to charge", "--account"),
        RunOpt("time", "str", "Slurm time limit, e.g. 4:00:00", "--time"),
        RunOpt("gpus_per_node", "posint", "GPUs used per node (default: the partition's)",
               "--gpus-per-node"),
        RunOpt("slurm_arg", "list", "passed to sbatch as is, e.g. --mem=64G", "--slurm-arg"),
    )  # fmt: skip

    def __init__(self, home: Path | None = None, registry: str | None = None):
        self.home = home or settings.home()
        self.registry = registry
        self._stop = threading.Event()
        self._watch = None

    # -- submit ---------------------------------------------------------------------------

    def dryrun(self, spec, check_packages: bool = False) -> Request:
        from areal_cli.schedulers.slurm import planner

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
        from areal_cli.schedulers.slurm import job

        plan = request.plan
        rec = job.submit(plan, self.home, request.spec.world_size)
        handle = self._handle(rec)
        if on_event:
            on_event("submitted", {"what": f"Slurm job {rec.job_id}", "job_id": rec.job_id})
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
            # Ctrl-C while a detached start waits means "never mind": the job goes too.
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
        from areal_cli.schedulers.slurm import records

        return [self._handle(r) for r in records.load(self.home, experiment, trial, kind)]

    def describe(self, handle: Handle) -> JobStatus | None:
        from areal_cli.schedulers.slurm import records

        recs = records.load(self.home, handle.experiment, handle.trial, handle.kind)
        recs = [r for r in recs if handle.job_id in (None, r.job_id)]
        if not recs:
            return None
        return self._statuses(recs[:1], include_ended=True)[0]

    def list(self, include_ended: bool = False) -> list[JobStatus]:
        if not (self.home / "slurm").is_dir():
            return []  # Slurm never used from this home: nothing to import, nothing to ask
        from areal_cli.schedulers.slurm import records

        recs = records.all_records(self.home)
        if not recs:
            return []
        return self._statuses(recs, include_ended)

    def _statuses(self, recs: list, include_ended: bool) -> list[JobStatus]:
        from areal_cli.errors import ArealError
        from areal_cli.schedulers.slurm import cluster, job

        if any(r.live for r in recs):
            try:
                job.refresh(recs, self.home)
            except (UsageError, cluster.Unreachable):
                raise  # a controller that does not answer says nothing of any job: exit 3
            except ArealError as e:
                for r in recs:
                    if r.live:
                        r.reason = f"squeue: {e.message}"
        rows = [r for r in recs if include_ended or r.live]
        return [self._status(r) for r in rows]

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
                    # Anyone who writes the registry can copy an entry of ours: only those
                    # the job signed are its servers (and may be asked with its key).
                    entries = [e for e in entries if apikeys.unproven(key, e) is None]
                health = discovery.healthy([e.addr for e in entries])
                backend = (entries[0].backend if entries else None) or "sglang"
                paused = control.paused_all([e.addr for e in entries], backend, key, 1.0)
            from areal_cli.schedulers.slurm.job import ended_replicas

            ended = ended_replicas(rec)
            gone = {addr for _, addr in ended.values()}
            entries = [e for e in entries if e.addr not in gone]
            order = _replica_order(rec)
            entries.sort(key=lambda e: order.get(e.addr, len(order)))
            servers = [
                ServerStatus(addr=e.addr, healthy=bool(health.get(e.addr)), pid=e.pid,
                             gpus=e.gpus, node=e.node, paused=paused.get(e.addr) is True)
                for e in entries
            ]  # fmt: skip
            # A replica that registered once but is out of discovery now (its runner took it
            # out while it does not answer) is listed too, unhealthy.
            listed = {e.addr for e in entries}
            for addr in sorted(order, key=order.get):
                if addr not in listed and addr not in gone:
                    servers.append(ServerStatus(addr=addr, healthy=False))
            # A replica whose step ended (`scancel J.S`, a crash) is listed dead, with its code.
            for i, (code, addr) in sorted(ended.items()):
                servers.append(ServerStatus(addr=addr or f"server-{i}", healthy=False,
                                            exit_code=code))  # fmt: skip
            if state == "running" and len(set(order.values()) | set(ended)) < rec.replicas:
                state = "starting"  # a replica neither registered once nor ended yet
            if ended:
                from areal_cli.schedulers.common import describe_exit

                rec.reason = "; ".join(
                    f"server-{i} ended ({describe_exit(code)})" for i, (code, _) in ended.items()
                )
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
            watchdog=_stall(rec),
        )

    def _handle(self, rec) -> Handle:
        return Handle(self.name, rec.experiment, rec.trial, rec.kind, rec.job_id)

    def _record(self, handle: Handle):
        from areal_cli.schedulers.slurm import records

        recs = records.load(self.home, handle.experiment, handle.trial, handle.kind)
        recs = [r for r in recs if handle.job_id in (None, r.job_id)]
        if not recs:
            raise UsageError(f"no Slurm job {handle.name} under {records.root(self.home)}")
        return recs[0]

    def check_rows(self, registry: str | None) -> list:
        """`areal doctor check --scheduler slurm`: Slurm's version and controller, each
        partition, whether the nodes see the shared files."""
        from areal_cli.schedulers.slurm import check

        return check.rows(self.home, settings.registry_url(registry or self.registry))

    # -- the doctor's reach --------------------------------------------------------------

    def run_on_nodes(
        self, job_id: str, commands: dict[str, list[str]], timeout: float
    ) -> dict[str, tuple[str | None, str | None]]:
        """node → (stdout, why not) of a short command run on each node of the job at once,
        each by `srun --overlap` into the job (its het group for a heterogeneous job)."""
        import subprocess
        from concurrent.futures import ThreadPoolExecutor

        groups = _het_groups(job_id)

        def one(node: str) -> tuple[str | None, str | None]:
            # The node's name in areal's terms, as its steps have it (slurm/step.py).
            argv = ["srun", "--overlap", f"--jobid={job_id}", "-w", node, "--nodes=1",
                    "--ntasks=1", "--quiet", f"--export=ALL,AREAL_NODE_NAME={node}",
                    *commands[node]]  # fmt: skip
            if node in groups:
                argv.insert(3, f"--het-group={groups[node]}")
            try:
                res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                     check=False)  # fmt: skip
            except subprocess.TimeoutExpired:
                return None, f"no answer from node {node} within {timeout:g}s"
            except OSError as e:
                return None, f"cannot run srun: {e}"
            if res.stdout.strip():
                return res.stdout, None
            from areal_cli.schedulers.slurm.cluster import slurm_message

            why = (
                slurm_message(res.stderr) if res.stderr.strip() else f"srun exited {res.returncode}"
            )
            return None, f"node {node} cannot be reached: {why}"

        with ThreadPoolExecutor(max_workers=max(1, len(commands))) as ex:
            return dict(zip(commands, ex.map(one, commands), strict=True))

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
        """scancel, wait until every step ended; then no registry entry and no process of the
        job is left (on this host: a step Slurm lost track of)."""
        from areal_cli.schedulers.slurm import job

        rec = self._record(handle)
        job.refresh([rec], self.home)
        was_running = rec.state in LIVE
        info = None
        if was_running:
            info = job.cancel(rec, self.home, timeout, job.STOPPED_BY_AREAL)
        left: list[str] = []
        deregistered = job.finish(rec, self.home, info, left)
        cancelled = f"Slurm job {rec.job_id}" if was_running else None
        return StopResult(rec.name, was_running, int(was_running), deregistered, cancelled,
                          left=left)  # fmt: skip


def _stall(rec) -> dict | None:
    """The last stall the job's watchdog diagnosed (it runs in the batch job)."""
    from areal_cli.schedulers.slurm.watch import read_stall

    return read_stall(rec.run_dir) if rec.kind != "serve" else None


def _het_groups(job_id: str) -> dict[str, int]:
    """node → its component, for a heterogeneous job (srun reaches it with --het-group)."""
    from areal_cli.errors import ArealError
    from areal_cli.schedulers.slurm import cluster

    try:
        info = cluster.jobs([job_id]).get(job_id)
    except ArealError:
        return {}
    if info is None or len(info.components) < 2:
        return {}
    return {n: offset for offset, names in info.components.items() for n in names}


def _replica_order(rec) -> dict[str, int]:
    """addr → replica index, from the files the replica runners leave in the run folder (the
    registry does not know which replica a server is; its log file does: server-N.log)."""
    import json

    out = {}
    for path in Path(rec.run_dir).glob("server-*.ready"):
        try:
            out[json.loads(path.read_text())["addr"]] = int(path.stem.split("-")[1])
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return out
