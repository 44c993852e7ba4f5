"""The ranks of a job named by its record (`--job E/T`): the status its scheduler describes
(handle, pids, marker, nodes, state), and how its nodes are reached, both handed in by the
caller that knows the scheduler. The doctor itself knows no scheduler.
"""

from __future__ import annotations

from collections.abc import Callable

from areal_cli import procs
from areal_cli.diagnose.targets import Job, NoSuchProcess, RankProc, Tree, exited, number
from areal_cli.errors import ArealError, UsageError
from areal_cli.registry import open_registry

# Seconds a doctor waits for the ranks of a local training job that is still starting them.
RANKS_START_S = 30.0


def from_record(
    record, reach: Callable | None = None, lead: float = 0.5, what: str | None = None
) -> Job:
    """The job of a scheduler's record (its status: handle, pids, marker, nodes, state). The
    caller, which knows the scheduler, hands in how its nodes are reached: with `reach` (the
    scheduler's run_on_nodes; `lead`, its node_start_s; `what`, how it names the job) the
    ranks are on the record's nodes, without it on this host. UsageError (exit 2) when none
    can be found."""
    try:
        if reach is not None:
            return _from_cluster_record(record, reach, lead, what or f"job {record.handle.job_id}")
        return _from_local_record(record)
    except NoSuchProcess as e:
        raise exited(e) from None


def _from_local_record(job) -> Job:
    ranks = _local_ranks(job)
    if not ranks and _starting(job):
        # `areal train --detach` returns once the job is placed, before torchrun has spawned
        # its ranks: a doctor asked right then waits for them rather than calling the job dead.
        found: list = []

        def started() -> bool:
            found[:] = _local_ranks(job)
            return bool(found) or not _starting(job)

        procs.wait_until(started, timeout=RANKS_START_S, cap=0.25)
        ranks = found
        if not ranks and _starting(job):
            raise UsageError(
                f"job {job.handle.name} is {job.state} but its ranks have not started after "
                f"{RANKS_START_S:g}s",
                hint=f"`areal ps` says what it waits for; `areal logs {job.handle.name} --role "
                "torchrun` shows its launcher's lines",
            )
    if not ranks:
        raise UsageError(
            f"job {job.handle.name} has no live rank processes on this host (state: {job.state})",
            hint=f"`areal ps` shows its state; `areal logs {job.handle.name}` shows why it ended",
        )
    launcher = next((p for p in job.pids[1:] if procs.pid_alive(p)), None)
    return Job(label=f"job {job.handle.name}", ranks=number(ranks), launcher_pid=launcher,
               name=job.handle.name)  # fmt: skip


def _local_ranks(job) -> list:
    tree = Tree()
    roots = [p for p in job.pids if procs.pid_alive(p)]
    candidates = {pid for root in roots for pid in tree.descendants(root)}
    if job.marker:
        candidates.update(p.pid for p in procs.find_marked(job.marker))
    return tree.topmost_ranks(candidates)


def _starting(job) -> bool:
    """A training job whose supervisor runs and has not ended it: its ranks are on the way."""
    return (job.handle.kind == "train" and job.state in ("starting", "running")
            and bool(job.pids) and procs.pid_alive(job.pids[0]))  # fmt: skip


def _from_cluster_record(job, reach: Callable, lead: float, what: str) -> Job:
    """A job on a cluster's nodes: its ranks from the registry's rank table (node and pid of
    each); nodes the table says nothing of are searched for the job's ranks there."""
    name = job.handle.name
    if job.state not in ("running", "starting", "stopping"):
        raise UsageError(
            f"job {name} ({what}) is {job.state}: no ranks to dump",
            hint=f"`areal ps --all` shows its state; `areal logs {name}` shows why it ended",
        )
    try:
        table = open_registry(job.registry).ranks(job.handle.experiment, job.handle.trial)
    except (ArealError, OSError):
        table = []
    table = [r for r in table if r.marker == job.marker and r.node]
    ranks = [
        RankProc(pid=r.pid, rank=r.rank, local_rank=r.local_rank, world_size=r.world_size,
                 local_world_size=None, cmdline=[], node=r.node)
        for r in table
    ]  # fmt: skip
    nodes: dict[str, list[int]] = {}
    for r in ranks:
        nodes.setdefault(r.node, []).append(r.pid)
    world = max((r.world_size for r in ranks), default=0)
    if not ranks or len(ranks) < world:
        # Not every rank recorded (a script that never called worker.connect()): look on
        # every node of the job for its processes.
        nodes = {n: [] for n in job.nodes}
    if not nodes:
        raise UsageError(
            f"job {name} ({what}) has no nodes yet (state: {job.state})",
            hint="`areal ps` shows whether it still waits in the queue",
        )
    return Job(
        label=f"job {name} ({what}, nodes {','.join(nodes)})",
        ranks=sorted(ranks, key=lambda r: r.rank),
        name=name,
        scheduler_job_id=job.handle.job_id,
        nodes=nodes,
        marker=job.marker,
        reach=reach,
        lead=lead,
    )
