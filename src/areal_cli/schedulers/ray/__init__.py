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
import sys
from pathlib import Path

from areal_cli import plugins, settings
from areal_cli.errors import UsageError
from areal_cli.schedulers.api import LIVE, Handle, RunOpt, StopResult
from areal_cli.schedulers.cluster import ClusterScheduler


class RayScheduler(ClusterScheduler):
    name = "ray"
    label = "Ray"  # "Ray job 6294eae8"
    # The node's command runs in its actor's own process (a call, no process to start).
    node_start_s = 0.15
    runopts = (
        RunOpt("address", "str", "the cluster's head, HOST:PORT (default RAY_ADDRESS)"),
        RunOpt("gpus_per_node", "posint", "training ranks per node (default: world / "
               "--nnodes, else the largest node's GPUs, or CPUs without GPUs)",
               "--gpus-per-node"),
    )  # fmt: skip

    def __init__(
        self, home: Path | None = None, registry: str | None = None, address: str | None = None
    ):
        super().__init__(home, registry)
        self.address = address

    def schedule(self, request, *, detach: bool, **kw) -> Handle:
        if detach and request.plan.max_restarts:
            # The trainers are restarted by the areal that follows the job (job.follow); a
            # detached job has none once the command returned.
            raise UsageError(
                "--max-restarts on Ray needs the job in the foreground (areal restarts it)",
                hint="drop --detach (tmux or nohup keep a foreground job running)",
            )
        return super().schedule(request, detach=detach, **kw)

    # -- hooks of ClusterScheduler ----------------------------------------------------------

    def _plan_options(self, spec) -> dict:
        return {"address": getattr(spec.scheduler_opts, "address", None) or self.address}

    def _submitted(self, rec, on_event) -> None:
        """Nothing yet: the job's lifecycle tells it once Ray placed it, naming its nodes."""

    def _stall(self, rec) -> dict | None:
        """The last stall the job's watchdog diagnosed (it runs in the job's first training
        actor, schedulers/ray/watch.py)."""
        from areal_cli.schedulers.ray.watch import read_stall

        return read_stall(rec.run_dir) if rec.kind != "serve" else None

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
        from areal_cli.schedulers.ray import cluster, records, watch

        recs = [r for r in records.all_records(self.home) if r.job_id == job_id]
        if not recs:
            raise UsageError(f"no Ray job {job_id} under {records.root(self.home)}")
        cluster.connect(recs[0].address)
        return watch.run_by_actors(recs[0].actors, job_id, commands, timeout)

    # -- logs, stop -----------------------------------------------------------------------

    def cancel(self, handle: Handle, timeout: float = 30.0) -> StopResult:
        """Stop every runner, kill the actors, remove the group, end what is left of the job
        on each of its nodes; then no registry entry and no process of it is left."""
        from areal_cli.schedulers.ray import cluster, job

        rec = self._record(handle)
        try:
            job.refresh([rec], self.home)
        except cluster.Unreachable as e:
            # Nothing can be asked of the cluster (its head is gone), but the job's processes
            # on this host need no Ray to be found: they carry its marker. The record stays
            # as it is: the nodes elsewhere and the registry wait for a stop that reaches Ray.
            from areal_cli import procs

            swept = procs.kill_job(rec.marker, grace=3.0) if rec.marker else 0
            here = (
                f"{swept} process(es) of {rec.name} on this host ended by its marker"
                if swept
                else f"no process of {rec.name} runs on this host"
            )
            raise cluster.Unreachable(
                e.message,
                hint=(e.hint + "; " if e.hint else "")
                + f"`areal stop {rec.name}` again once the cluster answers ends the rest",
                detail="\n".join(filter(None, [e.detail, here])),
            ) from None
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


def _exit_at_once() -> bool:
    """Once Ray was imported, its client threads and exit hooks take a second and more to
    wind down: leave the cluster now (what Ray's exit hook would do, without its wait) and
    let areal exit at once."""
    if "ray" not in sys.modules:
        return False
    cluster = sys.modules.get("areal_cli.schedulers.ray.cluster")
    if cluster is not None:
        cluster.disconnect()
    return True


plugins.exit_hooks.append(_exit_at_once)
