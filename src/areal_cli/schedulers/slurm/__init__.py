"""The Slurm scheduler: a job is one batch job on a Slurm cluster.

    planner.py  JobSpec → SlurmPlan: nodes, GPUs, steps, checked against the partition
    script.py   the batch script (what --dry-run prints)
    job.py      submit, watch (squeue, the runners' files), the outcome, the cleanup
    records.py  records of submitted jobs in AREAL_HOME
    cluster.py  sbatch, squeue --json, scancel, sinfo, scontrol, srun into a running job

Each server replica is a job step running the replica runner (launchers/replica.py) on its
node: it binds the node's address, health-gates the server and registers it with its Slurm job,
step and node. Training is one step with a torchrun per node (launchers/torchrun.py). The
batch job needs no `areal` process to run: `areal` submits and watches it, and `areal stop`
cancels it. Logs are files in the trial's folder on the shared filesystem.

Importing this package runs no Slurm command: `areal ps` lists every scheduler.
"""

from __future__ import annotations

from areal_cli import settings
from areal_cli.errors import ArealError, UsageError
from areal_cli.schedulers.api import LIVE, Handle, RunOpt, StopResult
from areal_cli.schedulers.cluster import ClusterScheduler


class SlurmScheduler(ClusterScheduler):
    name = "slurm"
    label = "Slurm"  # "Slurm job 58"
    killed_by = "Slurm preemption"  # PREEMPTED: the only way Slurm kills a job of ours
    runopts = (
        RunOpt("partition", "str", "Slurm partition (default: the cluster's)", "--partition"),
        RunOpt("account", "str", "Slurm account to charge", "--account"),
        RunOpt("time", "str", "Slurm time limit, e.g. 4:00:00", "--time"),
        RunOpt("gpus_per_node", "posint", "GPUs used per node (default: the partition's)",
               "--gpus-per-node"),
        RunOpt("slurm_arg", "list", "passed to sbatch as is, e.g. --slurm-arg=--mem=64G",
               "--slurm-arg"),
    )  # fmt: skip

    # -- hooks of ClusterScheduler ----------------------------------------------------------

    def _refresh(self, recs: list) -> None:
        from areal_cli.schedulers.slurm import cluster, job

        try:
            job.refresh(recs, self.home)
        except (UsageError, cluster.Unreachable):
            raise  # a controller that does not answer says nothing of any job: exit 3
        except ArealError as e:
            for r in recs:
                if r.live:
                    r.reason = f"squeue: {e.message}"

    def _stall(self, rec) -> dict | None:
        """The last stall the job's watchdog diagnosed (it runs in the batch job)."""
        from areal_cli.schedulers.lifecycle import read_stall

        return read_stall(rec.run_dir) if rec.kind != "serve" else None

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
        from areal_cli.schedulers.slurm import cluster

        return cluster.run_on_nodes(job_id, commands, timeout)

    # -- stop -----------------------------------------------------------------------------

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
