"""JobSpec → RayPlan: one actor per server replica holding its t·p GPUs (CPUs on a cluster
without GPUs), wherever Ray puts it; for training a placement group of one bundle per node
(gang scheduled: all bundles or none, STRICT_SPREAD over several nodes) and one torchrun per
bundle, meeting at a port on the first. Checked against the cluster's nodes before anything
starts: what no node could ever hold is refused here (exit 2), with what each node has.

Ranks per node: --gpus-per-node, else world / --nnodes when --nnodes is given, else the
largest node's GPUs (its CPUs on a cluster without GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from areal_cli import backends
from areal_cli.errors import UsageError
from areal_cli.launchers.replica import PORT_TOKEN
from areal_cli.registry import Registry
from areal_cli.schedulers import cluster_plan
from areal_cli.schedulers.cluster_plan import ClusterPlan
from areal_cli.schedulers.common import opened
from areal_cli.schedulers.ray import cluster, records
from areal_cli.spec import JobSpec, ProcessPlan

PLAN_FILE = "plan.json"
TRAINER_ENV_FILE = "trainer.env"


@dataclass
class RayProcess(ProcessPlan):
    """A server replica's actor, or the training nodes' actors (one per bundle)."""

    nodes: int = 1
    resources: dict = field(default_factory=dict)  # per actor: {"CPU": n} / {"GPU": n, ...}

    @property
    def placement(self) -> str:
        what = ", ".join(f"{v:g} {k}" for k, v in self.resources.items()) or "nothing"
        if self.role == "server":
            return f"one actor holding {what}, on any node"
        return f"{self.nodes} actor(s) holding {what} each, one placement group"


@dataclass
class RayPlan(ClusterPlan):
    process_type = RayProcess
    address: str = ""
    run_dir: str = ""
    job_id: str = ""  # areal's id of it on Ray: actors and the group are named by it
    strategy: str = ""  # the placement group's
    with_gpus: bool = False
    nodes_seen: list[str] = field(default_factory=list)  # the cluster when planned

    def actor_names(self) -> list[str]:
        return [actor_name(self.marker, label) for label in labels(self)]


def labels(plan: RayPlan) -> list[str]:
    out = [f"server-{p.index}" for p in plan.servers]
    for t in plan.trainers:
        out += [f"torchrun-{k}" for k in range(t.nodes)]
    return out


def actor_name(marker: str, label: str) -> str:
    return f"{marker}/{label}"


def group_name(marker: str) -> str:
    return f"{marker}/trainers"


def plan(spec: JobSpec, home: Path, registry: Registry | str, address: str,
         check_packages: bool = True) -> RayPlan:  # fmt: skip
    cluster.connect(address)
    nodes = cluster.nodes()
    with_gpus = any(n.total.get("GPU") for n in nodes)
    registry = opened(registry)
    fields = cluster_plan.cluster_fields(
        spec, home, registry, records.trial_dir(home, spec.experiment, spec.trial)
    )
    p = RayPlan(
        **fields,
        scheduler="ray",
        address=cluster.address(address),
        job_id=fields["marker"][-8:],
        with_gpus=with_gpus,
        nodes_seen=[n.describe() for n in nodes],
    )
    if spec.servers:
        _plan_servers(p, spec, check_packages)
    if spec.trainer:
        _plan_trainer(p, spec, nodes, registry)
    check_feasible(p, nodes)
    return p


def _plan_servers(p: RayPlan, spec: JobSpec, check_packages: bool) -> None:
    role, backend = cluster_plan.server_role(spec)
    gpr = role.gpus_per_replica
    if backend.needs_gpu and not p.with_gpus and not backend.runs_on_cpu:
        raise UsageError(
            f"{role.backend} needs GPUs and no node of the Ray cluster has one",
            hint="add GPU nodes, or --backend hf",
        )
    if check_packages:
        backends.check_installed(backend, role.python)
    key = cluster_plan.server_key(p, spec)
    need = {"GPU": float(gpr)} if p.with_gpus else {"CPU": float(gpr)}
    for i in range(role.replicas):
        argv = backend.node_argv(backend.argv(role, PORT_TOKEN, key, on_gpu=p.with_gpus))
        env = backend.env(role, key, on_gpu=p.with_gpus)
        p.processes.append(
            RayProcess(
                **cluster_plan.replica_fields(p, role, backend, i, argv, env),
                resources=need,
            )
        )
    cluster_plan.served(p, role)


def _plan_trainer(p: RayPlan, spec: JobSpec, nodes, registry) -> None:
    t = spec.trainer
    world = spec.train_dims().world_size
    unit = "GPU" if p.with_gpus else "CPU"
    biggest = int(max((n.total.get(unit, 0) for n in nodes), default=0))
    per_node = (
        spec.scheduler_opts.gpus_per_node
        or (world // t.nnodes if t.nnodes > 1 else None)
        or min(world, biggest or world)
    )
    if world % per_node:
        raise UsageError(
            f"{world} training ranks do not split over nodes of {per_node} rank(s)",
            hint="make the world size a multiple of --gpus-per-node (or of --nnodes)",
        )
    nnodes = world // per_node
    # CUDA_VISIBLE_DEVICES: the bundle's GPUs, set on the node (actor.Step.start).
    fields = cluster_plan.trainer_fields(p, spec, registry, nnodes, per_node)
    fields["env"].setdefault("OMP_NUM_THREADS", "1" if not p.with_gpus else "4")
    need = {"GPU": float(per_node), "CPU": 1.0} if p.with_gpus else {"CPU": float(per_node)}
    p.strategy = "STRICT_SPREAD" if nnodes > 1 else "STRICT_PACK"
    p.processes.append(
        RayProcess(
            **fields,
            nodes=nnodes,
            resources=need,
        )
    )


def check_feasible(p: RayPlan, nodes) -> None:
    """What no node of the cluster could ever hold, however long one waits: exit 2 now,
    naming what is missing and what each node has."""
    have = "; ".join(n.describe() for n in nodes) or "no live node"
    for s in p.servers:
        if not any(cluster.fits(s.resources, n.total) for n in nodes):
            raise UsageError(
                f"server-{s.index} needs {cluster.words(s.resources)} on one node, and no node "
                f"of the Ray cluster has that: {have}",
                hint="lower t·p, or add nodes that have it",
            )
    for t in p.trainers:
        able = [n for n in nodes if cluster.fits(t.resources, n.total)]
        if len(able) < t.nodes:
            raise UsageError(
                f"training needs {t.nodes} node(s) with {cluster.words(t.resources)} each "
                f"({p.strategy}), and the Ray cluster has {len(able)} such node(s): {have}",
                hint="lower the ranks per node (--gpus-per-node, --nnodes) or the world size",
            )
