"""One submitted Slurm job, from `areal`'s side: submit it, watch it start (squeue) and its
servers register (the runners' files in the run folder), follow it to its end, tell why it
ended, and leave nothing behind (registry entries, stray processes).

The batch job itself needs none of this to run: killing `areal` leaves it running, and
`areal stop` ends it later.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from areal_cli import logfiles, schedulers
from areal_cli.errors import ArealError, LaunchError, UsageError, WaitTimeout
from areal_cli.registry import open_registry
from areal_cli.schedulers import lifecycle
from areal_cli.schedulers.api import ENDED, LIVE, Stopped
from areal_cli.schedulers.cluster import (
    SlotLock,
    clash,
    drop_old_runs,
    ended_replicas,
    new_run_folder,
    read_code,
    record_fields,
    refusal,
    reread,
)
from areal_cli.schedulers.cluster_live import deregister_servers, leave_nothing
from areal_cli.schedulers.common import describe_exit, tail_text
from areal_cli.schedulers.slurm import cluster, records
from areal_cli.schedulers.slurm.planner import SlurmPlan
from areal_cli.schedulers.slurm.records import SlurmRecord
from areal_cli.schedulers.slurm.script import PLAN_FILE, TRAINER_ENV_FILE, supervisor_log

POLL = 0.2  # seconds between squeue calls while waiting (each costs the controller an RPC)
STOPPED_BY_AREAL = "stopped by areal stop"
# Pending reasons no wait resolves (squeue's words; src/common/job_state_reason.c): the job as
# submitted does not fit the partition, account or QOS. A cluster without EnforcePartLimits
# queues such a job instead of refusing it.
NEVER = frozenset({
    "AccountNotAllowed", "InvalidAccount", "QOSNotAllowed", "InvalidQOS", "BadConstraints",
    "PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "DependencyNeverSatisfied",
})  # fmt: skip
EventFn = Callable[[str, dict], None]


# -- submitting ----------------------------------------------------------------------------


def submit(plan: SlurmPlan, home: Path, world_size: int) -> SlurmRecord:
    """Write the run folder (private plan, the trainers' environment, the script), sbatch it,
    record it. One live job per slot: a second submission is refused, naming the first."""
    with SlotLock(records.trial_dir(home, plan.experiment, plan.trial), plan, "submitted"):
        refuse_if_running(home, plan)
        previous = records.load(home, plan.experiment, plan.trial, plan.kind)
        run = new_run_folder(plan, PLAN_FILE, TRAINER_ENV_FILE)
        try:
            (run / "job.sh").write_text(plan.script)
            job_id = cluster.sbatch(str(run / "job.sh"), plan.job_name)
        except BaseException:
            shutil.rmtree(run, ignore_errors=True)
            raise
        rec = SlurmRecord(**record_fields(plan, world_size), job_id=job_id)
        records.write(home, rec)
    drop_old_runs(previous, rec)
    return rec


def refuse_if_running(home: Path, plan: SlurmPlan) -> None:
    """A serving and a training job may share E/T; a second of the same kind may not, on this
    scheduler or any other."""
    mine = records.load(home, plan.experiment, plan.trial)
    refresh(mine, home)
    found = [(r.kind, f"Slurm job {r.job_id}, {r.state}") for r in mine if r.live]
    for sched, h in schedulers.known_jobs(plan.experiment, plan.trial, home=home):
        if sched.name == plan.scheduler:
            continue  # this scheduler's own: read above
        job = sched.describe(h)
        if job is not None and job.state in LIVE:
            where = f"pid {job.pids[0]}" if job.pids else f"job {h.job_id}"
            found.append((h.kind, f"{sched.name}, {where}"))
    for kind, what in found:
        if clash(plan, kind):
            raise refusal(plan, kind, what)


# -- what squeue says ------------------------------------------------------------------------


def refresh(recs: list[SlurmRecord], home: Path) -> None:
    """Bring live records up to date with squeue (one call for all); a job that ended since is
    finished: its outcome recorded, its registry entries gone. Only positive evidence ends a
    job: squeue listing it as ended, its own exit file, or the controller saying it no longer
    knows it. A controller that does not answer raises cluster.Unreachable before anything is
    written, removed or killed."""
    reread(recs, records, home)
    live = [r for r in recs if r.live]
    if not live:
        return
    infos = cluster.jobs([r.job_id for r in live])
    for rec in live:
        info = infos.get(rec.job_id)
        if info is not None:
            update(rec, info)
            if info.state in ENDED:
                finish(rec, home, info)
            else:
                reap_replicas(rec)
                records.write(home, rec)
            continue
        # Not in squeue's list: what the batch script left, else ask about this job alone.
        code = read_code(Path(rec.run_dir) / "job.exit")
        if code is None and cluster.known(rec.job_id):
            continue  # listed a moment later (squeue's list and the job raced): next time
        rec.state = "dead" if code is None else ("stopped" if code == 0 else "failed")
        rec.exit_code = code
        rec.message = rec.message or (
            "ended unseen; Slurm no longer knows it"
            if code is None
            else f"ended ({describe_exit(code)})"
        )
        finish(rec, home, None)


def reap_replicas(rec: SlurmRecord) -> int:
    """Take replicas whose step ended (`scancel J.S`, a crash) out of discovery. Returns the
    entries removed."""
    addrs = {addr for _, addr in ended_replicas(rec).values() if addr}
    return deregister_servers(rec, addrs) if addrs else 0


def update(rec: SlurmRecord, info: cluster.JobInfo) -> None:
    # An areal that cancels a job first records why (see cancel): then it was stopped, not
    # cancelled by someone else, whoever sees the end first.
    by_areal = rec.state == "stopping" and rec.message is not None
    rec.slurm_state = info.slurm_state
    rec.state = "stopped" if info.state == "cancelled" and by_areal else info.state
    rec.nodes = info.nodes or rec.nodes
    rec.reason = info.reason if info.state == "pending" else None
    rec.exit_code = info.exit_code if info.state in ENDED else rec.exit_code
    if info.start_time and info.state != "pending":
        rec.started = float(info.start_time)


def finish(
    rec: SlurmRecord, home: Path, info: cluster.JobInfo | None, left: list[str] | None = None
) -> int:
    """The job has ended: nothing of it stays in discovery, nothing of it runs on this host,
    the record says how it ended. Returns the registry entries removed; what could not be
    removed is told in `left`."""
    stalled = lifecycle.failed_by_watchdog(rec.run_dir)
    if stalled is not None and (rec.message is None or rec.message.startswith("ended (")):
        # --watchdog-action fail ended it: that stall is why, not the step's exit code.
        rec.state, rec.exit_code = "failed", 1
        rec.message = f"watchdog: {lifecycle.headline(stalled)}"
    if info is not None and rec.message is None:
        rec.message = {
            "cancelled": "cancelled outside areal (scancel, or an administrator)",
            "failed": f"Slurm: {info.slurm_state}",
        }.get(info.state)
    return leave_nothing(rec, home, records, PLAN_FILE, left)


def cancel(rec: SlurmRecord, home: Path, timeout: float, reason: str) -> cluster.JobInfo | None:
    """scancel, then wait (up to `timeout`) until Slurm has ended every step. The record says
    why first, so that an `areal` following the job tells a stop from a cancel by others."""
    before = rec.state
    rec.state, rec.message = "stopping", reason
    records.write(home, rec)
    try:
        cluster.scancel(rec.job_id)
    except cluster.Unreachable:
        # The reason stays (the cancel may reach the controller later: then it was ours).
        rec.state = before
        records.write(home, rec)
        raise
    deadline = time.monotonic() + timeout
    info = None
    while time.monotonic() < deadline:
        info = cluster.jobs([rec.job_id]).get(rec.job_id)
        if info is None or info.state in ENDED:
            break
        time.sleep(POLL)
    if info is not None:
        update(rec, info)
    rec.state = "stopped"
    rec.message = reason
    return info


# -- following one job from `areal` --------------------------------------------------------


def follow(plan: SlurmPlan, rec: SlurmRecord, home: Path, stop: threading.Event,
           on_event: EventFn | None = None, on_line=None, on_progress=None) -> lifecycle.Lifecycle:  # fmt: skip
    """The job's lifecycle over Slurm: pending → running → servers registered → its end."""
    return lifecycle.Lifecycle(Transport(plan, rec, home), stop, on_event, on_line, on_progress)


class Transport(lifecycle.Transport):
    """A batch job: placed and started by Slurm (squeue says when), its trainers restarted
    inside the allocation (slurm/restart.py), ended by scancel."""

    plan: SlurmPlan
    rec: SlurmRecord
    records = records

    def __init__(self, plan: SlurmPlan, rec: SlurmRecord, home: Path):
        super().__init__(plan, rec, home)
        self.info: cluster.JobInfo | None = None
        self.no_answer: cluster.Unreachable | None = None
        self._last_poll = 0.0

    @property
    def what(self) -> str:
        return f"Slurm job {self.rec.job_id}"

    def place(self) -> None:
        """Until Slurm starts the job; pending longer than the health timeout cancels it."""
        deadline = time.monotonic() + self.plan.health_timeout
        while True:
            self.life.check_stop()
            if not self._poll():
                if time.monotonic() > deadline:
                    raise self.no_answer  # nothing known of the job: left as it is
                time.sleep(POLL)
                continue
            info = self.info
            if info is None or info.state in ENDED:
                self._ended()
            if info.state != "pending":
                self.rec.state = "starting" if self.plan.servers else "running"
                records.write(self.home, self.rec)
                self.life.on_event("running", {"job_id": self.rec.job_id, "nodes": info.nodes})
                return
            self._pending(info, deadline)
            time.sleep(POLL)

    def _pending(self, info: cluster.JobInfo, deadline: float) -> None:
        """Still pending: said, and cancelled when no wait will run it or the wait is over."""
        self.life.on_progress(f"Slurm job {self.rec.job_id} pending ({info.reason or 'queued'})")
        if info.reason in NEVER:
            self.cancel(f"never runnable: {info.reason}")
            raise UsageError(
                f"Slurm will not run job {self.rec.job_id} as submitted (squeue: "
                f"{info.reason}); cancelled it",
                hint="check --partition, --account and --time against `sinfo` and "
                "`sacctmgr show assoc user=$USER`",
            )
        if time.monotonic() > deadline:
            reason = info.reason or "no reason given"
            self.cancel(f"pending longer than {self.plan.health_timeout:g}s")
            raise WaitTimeout(
                f"Slurm job {self.rec.job_id} still pending after "
                f"{self.plan.health_timeout:g}s (squeue: {reason}); cancelled it",
                hint="`squeue -j JOB --start` says when it may start; ask for fewer "
                "resources or raise --health-timeout",
            )

    def look_starting(self) -> None:
        if time.monotonic() - self._last_poll > POLL * 2.5:
            self._last_poll = time.monotonic()
            if self._poll() and (self.info is None or self.info.state in ENDED):
                self._ended()

    def look(self) -> int | None:
        self.life.tell_restarts()
        if self._poll() and (self.info is None or self.info.state in ENDED):
            self.life.tell_restarts()
            return self._ended()
        return None

    def server_lost(self, index: int) -> None:
        reap_replicas(self.rec)

    def cancel(self, reason: str) -> None:
        info = cancel(self.rec, self.home, 30.0, reason)
        self.life.close()
        finish(self.rec, self.home, info)

    # -- pieces ---------------------------------------------------------------------------

    def _poll(self) -> bool:
        """squeue's word on the job; False (self.info as it was) when the controller did not
        answer: a wait goes on, it concludes nothing."""
        try:
            self.info = cluster.jobs([self.rec.job_id]).get(self.rec.job_id)
        except cluster.Unreachable as e:
            self.no_answer = e
            self.life.on_progress(
                f"Slurm job {self.rec.job_id}: {cluster.controller()} not answering"
            )
            return False
        if self.info is None and self.exit_code("job") is None:
            try:
                if cluster.known(self.rec.job_id):
                    return False  # listed a moment later: no conclusion from this answer
            except cluster.Unreachable as e:
                self.no_answer = e
                return False
        if self.info is not None:
            before = self.rec.state
            update(self.rec, self.info)
            if self.info.state == "running" and before == "starting":
                self.rec.state = "starting"  # until its servers registered
        return True

    def _ended(self) -> int:
        """The job ended on its own (or from outside): its outcome, root cause first."""
        info = self.info
        self.life.close()
        if info is not None:
            update(self.rec, info)
        else:  # squeue forgot it already
            code = read_code(self.run / "job.exit")
            self.rec.state = "stopped" if code == 0 else "failed"
            self.rec.exit_code = code
        try:
            return self._outcome(info)
        except ArealError as e:
            self.rec.message, self.rec.detail = e.message, e.detail
            raise
        finally:
            finish(self.rec, self.home, info)

    def _outcome(self, info: cluster.JobInfo | None) -> int:
        job = f"Slurm job {self.rec.job_id}"
        state = info.slurm_state if info else ""
        if state == "CANCELLED":
            if STOPPED_BY_AREAL in (self._on_disk().message or ""):
                self.rec.state, self.rec.message = "stopped", STOPPED_BY_AREAL
                self.life.on_event("stopping", {"state": "stopped"})
                raise Stopped(143)  # as a local job stopped by `areal stop` (SIGTERM)
            raise LaunchError(
                f"{job} was cancelled (not by areal: scancel, or an administrator)",
                hint=f"`areal logs {self.rec.name}` shows how far it got",
            )
        if state == "NODE_FAIL":
            raise self._node_failure(info)
        if state in ("TIMEOUT", "DEADLINE"):
            raise LaunchError(f"{job} reached its time limit (Slurm: {state})",
                              hint="raise --time")  # fmt: skip
        if state == "OUT_OF_MEMORY":
            raise LaunchError(f"{job} ran out of memory (Slurm: OUT_OF_MEMORY)",
                              hint="ask for more with --slurm-arg=--mem=...")  # fmt: skip
        if self.plan.trainers:
            stalled = lifecycle.failed_by_watchdog(self.run)
            if stalled is not None:
                self.life.on_event("trainer_exit", {"label": "torchrun", "code": 1})
                why = f"watchdog: {lifecycle.headline(stalled)}"
                raise lifecycle.watchdog_failure(stalled, why)
            code = self.exit_code("torchrun")
            if code is None:
                code = info.exit_code if info and info.exit_code is not None else 1
            self.life.on_event("trainer_exit", {"label": "torchrun", "code": code})
            if code == 0:
                return 0
            raise self._trainer_failure(code)
        for i in range(len(self.plan.servers)):
            code = self.exit_code(f"server-{i}")
            if code:
                p = self.plan.servers[i]
                raise LaunchError(
                    f"server-{i} failed (no replica left): {describe_exit(code)}",
                    detail=tail_text(p.log_path),
                    hint=f"full log: {p.log_path}",
                )
        code = info.exit_code if info and info.exit_code is not None else 0
        if code:
            raise LaunchError(f"{job} ended with {describe_exit(code)}",
                              detail=tail_text(self._supervisor_log()))  # fmt: skip
        raise LaunchError(f"{job} ended: every server exited",
                          hint=f"areal logs {self.rec.name} --role server")  # fmt: skip

    def _on_disk(self) -> SlurmRecord:
        """The record as `areal stop` (another process) may have left it."""
        for rec in records.load(self.home, self.rec.experiment, self.rec.trial, self.rec.kind):
            if rec.job_id == self.rec.job_id:
                return rec
        return self.rec

    def _supervisor_log(self) -> str:
        return supervisor_log(self.plan)

    def _rank_nodes(self) -> dict[int, str]:
        try:
            ranks = open_registry(self.rec.registry).ranks(
                self.rec.experiment, self.rec.trial, include_dead=True
            )
        except (ArealError, OSError):
            return {}
        return {r.rank: r.node for r in ranks if r.marker == self.rec.marker and r.node}

    def _trainer_failure(self, code: int) -> LaunchError:
        return lifecycle.trainer_failure(self.plan.log_dir, code, self._supervisor_log(),
                                         lambda rank: self._rank_nodes().get(rank))  # fmt: skip

    def _node_failure(self, info: cluster.JobInfo) -> LaunchError:
        down = cluster.down_nodes(info.nodes) or info.nodes
        ranks = self._rank_nodes()
        lines = []
        for n in down:
            on = sorted(r for r, node in ranks.items() if node == n)
            servers = [f"server-{i}" for i, r in self.life.ready.items() if r.get("node") == n]
            what = [f"rank{'s' if len(on) > 1 else ''} {', '.join(map(str, on))}"] if on else []
            lines.append(
                f"node {n}" + (f" ({'; '.join(what + servers)})" if what or servers else "")
            )
        return LaunchError(
            f"Slurm job {self.rec.job_id}: {', '.join(lines)} failed (Slurm: NODE_FAIL)",
            detail="\n".join(
                f"rank-{r} on {node}: "
                + (logfiles.tail(Path(self.plan.log_dir) / f"rank-{r}.log", 1) or ["(no output)"])[
                    -1
                ]
                for r, node in sorted(ranks.items())
                if node in down
            )
            or None,
            hint="`sinfo -R` says why the node is down; the job was not requeued (--no-requeue)",
        )
