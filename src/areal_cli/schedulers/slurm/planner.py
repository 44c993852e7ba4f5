"""JobSpec → SlurmPlan: how many nodes, which replica or torchrun runs on which of them, with
how many GPUs, and the batch script that does it. Checked against the partition before
anything is submitted, so `--dry-run` shows exactly what would be queued.

Placement:
- servers: a replica needs t·p GPUs. Replicas fill a node's GPUs (--gpus-per-node, default
  the partition's); a replica wider than a node spans t·p / gpus-per-node nodes as one
  multi-node server. hf, the CPU reference server, runs one replica per node unless
  --gpus-per-node packs more.
- training: one torchrun per node, world / gpus-per-node nodes, rendezvous (c10d) on the
  first node at a port chosen there.
- both (hf:d1+fsdp:d2): a heterogeneous job, servers in component 0, trainers in 1.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from areal_cli import backends
from areal_cli.errors import UsageError
from areal_cli.launchers.replica import PORT_TOKEN
from areal_cli.registry import Registry
from areal_cli.schedulers import cluster_plan
from areal_cli.schedulers.cluster_plan import ClusterPlan
from areal_cli.schedulers.common import opened
from areal_cli.schedulers.job_records import slot
from areal_cli.schedulers.slurm import cluster, records
from areal_cli.schedulers.slurm.script import render
from areal_cli.spec import JobSpec, ProcessPlan


@dataclass
class SlurmProcess(ProcessPlan):
    """One job step: a server replica, or the torchrun of every training node."""

    group: int = 0  # the heterogeneous job's component (0 when there is one)
    node: int = 0  # the first node it runs on, within its component
    nodes: int = 1  # how many nodes it spans (one task on each)
    gpus_per_node: int = 0  # GPUs Slurm binds to it on each of its nodes
    follower_args: list[str] = field(default_factory=list)  # nodes after the first add these

    @property
    def placement(self) -> str:
        where = (
            f"node {self.node}"
            if self.nodes == 1
            else f"nodes {self.node}-{self.node + self.nodes - 1}"
        )
        gpus = f"{self.gpus_per_node} GPU(s) per node" if self.gpus_per_node else "no GPUs"
        return f"{where} of component {self.group}, {gpus} (bound by Slurm)"


@dataclass
class Component:
    """One part of the allocation: what `#SBATCH` asks for (per node)."""

    role: str  # "server" | "trainer"
    nodes: int
    tasks_per_node: int
    gpus_per_node: int


@dataclass
class SlurmPlan(ClusterPlan):
    process_type = SlurmProcess
    script: str = ""  # the batch script sbatch gets
    run_dir: str = ""  # the plan, the script, exit codes of its steps (on the shared filesystem)
    job_name: str = ""
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    slurm_args: list[str] = field(default_factory=list)
    components: list[Component] = field(default_factory=list)
    runner_python: str = ""  # runs the replica and torchrun runners on the nodes

    @property
    def nodes(self) -> int:
        return sum(c.nodes for c in self.components)

    @classmethod
    def from_json(cls, d: dict) -> SlurmPlan:
        components = [Component(**c) for c in d.get("components", [])]
        return super().from_json({**d, "components": components})


def plan(
    spec: JobSpec, home: Path, registry: Registry | str, check_packages: bool = True
) -> SlurmPlan:
    opts = spec.scheduler_opts
    cluster.require("sbatch")
    part = cluster.partition(opts.partition)
    part_gpus = part.gpus_per_node if part is not None else None
    if opts.gpus_per_node and part is not None and opts.gpus_per_node > part.gpus_per_node:
        raise UsageError(
            f"--gpus-per-node {opts.gpus_per_node}: the nodes of partition {part.name} have "
            f"{part.gpus_per_node} GPU(s) each",
            hint=f"use --gpus-per-node {part.gpus_per_node} or less, or another --partition "
            "(`sinfo -o '%P %G'` lists them)",
        )
    registry = opened(registry)
    trial_dir = records.trial_dir(home, spec.experiment, spec.trial)
    p = SlurmPlan(
        **cluster_plan.cluster_fields(spec, home, registry, trial_dir),
        scheduler="slurm",
        job_name=f"areal-{spec.experiment}-{spec.trial}-{slot(spec.kind)}",
        partition=opts.partition,
        account=opts.account,
        time=opts.time,
        slurm_args=list(opts.slurm_arg or ()),
        runner_python=sys.executable,
    )
    if spec.servers:
        _plan_servers(p, spec, part_gpus, check_packages)
    if spec.trainer:
        _plan_trainer(p, spec, part_gpus, registry)
    if part is not None and p.nodes > len(part.nodes):
        raise UsageError(
            f"the job needs {p.nodes} node(s) ("
            + " + ".join(f"{c.nodes} for the {c.role}s" for c in p.components)
            + f"), partition {part.name} has {len(part.nodes)}",
            hint="raise --gpus-per-node to pack more on a node, or lower d/t",
        )
    p.script = render(p)
    return p


def _plan_servers(p: SlurmPlan, spec: JobSpec, part_gpus: int | None, check_packages) -> None:
    role, backend = cluster_plan.server_role(spec)
    gpr = role.gpus_per_replica
    if backend.needs_gpu and part_gpus == 0:
        raise UsageError(
            f"{role.backend} needs GPUs and the partition's nodes have none",
            hint="pick a partition with GPUs (--partition; `sinfo -o '%P %G'`), or --backend hf",
        )
    if check_packages:
        backends.check_installed(backend, role.python)
    opts = spec.scheduler_opts
    per_node = opts.gpus_per_node or (part_gpus or gpr if backend.multi_gpu_replica else 1)
    with_gpus = part_gpus != 0
    if gpr > per_node:
        if gpr % per_node:
            raise UsageError(
                f"a replica of {gpr} GPUs (t·p) does not split over nodes of {per_node} GPUs",
                hint="make t·p a multiple of --gpus-per-node",
            )
        span, per_node_replicas = gpr // per_node, 1
    else:
        span, per_node_replicas = 1, per_node // gpr
    nodes = role.replicas * span if span > 1 else -(-role.replicas // per_node_replicas)
    gres = (
        (per_node if span > 1 else min(role.replicas, per_node_replicas) * gpr) if with_gpus else 0
    )
    group = len(p.components)
    p.components.append(Component("server", nodes, per_node_replicas, gres))
    key = cluster_plan.server_key(p, spec)
    for i in range(role.replicas):
        argv = backend.argv(role, PORT_TOKEN, key, on_gpu=with_gpus)
        follower: list[str] = []
        argv = backend.node_argv(argv)
        if span > 1:
            argv, follower = backend.multi_node_argv(role, argv, span)
        p.processes.append(
            SlurmProcess(
                **cluster_plan.replica_fields(p, role, backend, i, argv, backend.env(role, key)),
                group=group,
                node=i * span if span > 1 else i // per_node_replicas,
                nodes=span,
                gpus_per_node=(per_node if span > 1 else gpr) if with_gpus else 0,
                follower_args=follower,
            )
        )
    cluster_plan.served(p, role)


def _plan_trainer(p: SlurmPlan, spec: JobSpec, part_gpus: int | None, registry) -> None:
    world = spec.train_dims().world_size
    per_node = spec.scheduler_opts.gpus_per_node or part_gpus or world
    if world <= per_node:
        nnodes, nproc = 1, world
    elif world % per_node:
        raise UsageError(
            f"{world} training ranks do not split over nodes of {per_node} GPUs",
            hint="make the fsdp world size a multiple of --gpus-per-node",
        )
    else:
        nnodes, nproc = world // per_node, per_node
    group = len(p.components)
    p.components.append(Component("trainer", nnodes, 1, nproc if part_gpus != 0 else 0))
    p.processes.append(
        SlurmProcess(
            **cluster_plan.trainer_fields(p, spec, registry, nnodes, nproc),
            group=group,
            node=0,
            nodes=nnodes,
            gpus_per_node=nproc if part_gpus != 0 else 0,
        )
    )
