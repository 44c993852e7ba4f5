"""JobSpec → RayPlan: one actor per server replica holding its t·p GPUs (CPUs on a cluster
without GPUs), wherever Ray puts it; for training a placement group of one bundle per node
(gang scheduled: all bundles or none, STRICT_SPREAD over several nodes) and one torchrun per
bundle, meeting at a port on the first. Checked against the cluster's nodes before anything
starts: what no node could ever hold is refused here (exit 2), with what each node has.

Ranks per node: --gpus-per-node, else world / --nnodes when --nnodes is given, else the
largest node's GPUs (its CPUs on a cluster without GPUs).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from areal_cli import apikeys, backends, settings
from areal_cli.errors import UsageError
from areal_cli.launchers import torchrun
from areal_cli.launchers.node import NODE_ADDR
from areal_cli.launchers.replica import PORT_TOKEN
from areal_cli.registry import Registry
from areal_cli.schedulers.common import (
    areal_overrides,
    is_loopback,
    new_marker,
    opened,
    resolve_api_key,
    worker_env,
)
from areal_cli.spec import JobSpec, Plan, ProcessPlan

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
class RayPlan(Plan):
    address: str = ""
    run_dir: str = ""
    job_id: str = ""  # areal's id of it on Ray: actors and the group are named by it
    strategy: str = ""  # the placement group's
    with_gpus: bool = False
    nodes_seen: list[str] = field(default_factory=list)  # the cluster when planned

    def to_json(self, redact: bool = True) -> dict:
        d = super().to_json(redact)
        d["placement"] = {
            f"{p.role}-{p.index}" if p.role == "server" else "torchrun": p.placement
            for p in self.processes
        }
        return d

    @classmethod
    def from_json(cls, d: dict) -> RayPlan:
        d = {k: v for k, v in d.items() if k != "placement"}
        d["processes"] = [RayProcess(**p) for p in d.get("processes", [])]
        return cls(**d)

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


def slot(kind: str) -> str:
    return "serve" if kind == "serve" else "train"


def jobs_dir(home: Path, experiment: str, trial: str) -> Path:
    return home / "ray" / settings.user() / experiment / trial


def plan(spec: JobSpec, home: Path, registry: Registry | str, address: str,
         check_packages: bool = True) -> RayPlan:  # fmt: skip
    from areal_cli.schedulers.ray import cluster

    cluster.connect(address)
    nodes = cluster.nodes()
    with_gpus = any(n.total.get("GPU") for n in nodes)
    log_dir = settings.log_dir(home, spec.experiment, spec.trial)
    registry = opened(registry)
    marker = new_marker(spec.experiment, spec.trial)
    run_dir = jobs_dir(home, spec.experiment, spec.trial) / f"{slot(spec.kind)}-{marker[-8:]}"
    p = RayPlan(
        experiment=spec.experiment,
        trial=spec.trial,
        kind=spec.kind,
        log_dir=str(log_dir),
        home=str(home),
        registry=registry.url,
        marker=marker,
        alloc=spec.alloc,
        health_timeout=spec.health_timeout,
        scheduler="ray",
        registry_ttl=settings.registry_ttl(),
        address=cluster.address(address),
        run_dir=str(run_dir),
        job_id=marker[-8:],
        with_gpus=with_gpus,
        nodes_seen=[n.describe() for n in nodes],
        watchdog=spec.watchdog if spec.trainer else 0.0,
        watchdog_action=spec.watchdog_action,
    )
    if spec.servers:
        _plan_servers(p, spec, check_packages)
    if spec.trainer:
        _plan_trainer(p, spec, nodes, registry)
    check_feasible(p, nodes)
    return p


def _plan_servers(p: RayPlan, spec: JobSpec, check_packages: bool) -> None:
    role = spec.servers
    backend = backends.get(role.backend)
    # Other nodes must reach the servers: loopback becomes the node's own address.
    if is_loopback(role.host):
        role = replace(role, host=NODE_ADDR)
    backend.check_bind(role)
    gpr = role.gpus_per_replica
    if role.backend == "hf" and gpr != 1:
        raise UsageError(
            "the hf backend runs one replica per GPU (t1p1): it cannot span GPUs or nodes",
            hint="use d to add replicas, e.g. --alloc hf:d2",
        )
    if backend.needs_gpu and not p.with_gpus and not backend.runs_on_cpu:
        raise UsageError(
            f"{role.backend} needs GPUs and no node of the Ray cluster has one",
            hint="add GPU nodes, or --backend hf",
        )
    if check_packages:
        backends.check_installed(backend, role.python)
    key = resolve_api_key(spec.api_key)
    if key:
        p.api_key = key
        p.api_key_file = str(apikeys.key_file(Path(p.home), spec.experiment, spec.trial))
    need = {"GPU": float(gpr)} if p.with_gpus else {"CPU": float(gpr)}
    for i in range(role.replicas):
        argv = backend.argv(role, PORT_TOKEN, key, on_gpu=p.with_gpus)
        if role.backend == "hf" and "--device" in argv:
            argv[argv.index("--device") + 1] = "auto"  # whether CUDA works: known on the node
        p.processes.append(
            RayProcess(
                role="server",
                index=i,
                argv=argv,
                # The API key in the environment (the plan file is private), never in argv.
                env={"PYTHONUNBUFFERED": "1", **backend.env(role, key, on_gpu=p.with_gpus)},
                gpus=[],
                log_path=str(Path(p.log_dir) / f"server-{i}.log"),
                host=role.host,
                port=None,
                backend=role.backend,
                health_path=backend.health_path,
                first_request=backend.first_request(role),
                resources=need,
            )
        )
    p.model_path = role.model_path + (f"@{role.revision}" if role.revision else "")
    p.tp = role.tp


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
    env_extra: dict[str, str] = {}
    if spec.servers:
        # The job's own servers have addresses only once they run: rank 0 finds them in the
        # registry, as `areal train` does, and tells the other ranks.
        addrs, backend, key = [], spec.servers.backend, None
        env_extra = {
            "AREAL_WAIT_SERVERS": f"{spec.health_timeout:g}",
            "AREAL_MIN_SERVERS": str(spec.servers.replicas),
        }
    else:
        addrs, backend = list(spec.external_servers), spec.external_backend or "sglang"
        key = spec.external_api_key
        p.api_key = key  # only so the plan's rendering redacts it
    script_args = list(t.script_args)
    if t.areal_overrides:
        n = spec.servers.replicas if spec.servers else len(addrs)
        script_args += areal_overrides(spec, backend, n, registry)
    if nnodes == 1:
        rdzv = torchrun.Rendezvous()
    else:
        rdzv = torchrun.Rendezvous(nnodes, endpoint=torchrun.RDZV_TOKEN, backend="c10d")
    script = t.script if t.script == "-m" else str(Path(t.script).resolve())
    argv = torchrun.argv(
        t.python or sys.executable,
        per_node,
        [script, *script_args],
        rendezvous=rdzv,
        log_dir=Path(p.log_dir) / "torchrun",
    )
    # CUDA_VISIBLE_DEVICES: the bundle's GPUs, set on the node (actor.Step.start).
    env = worker_env(spec, t, p, addrs, backend, key, visible=None)
    env.update(env_extra)
    env["AREAL_SCHEDULER_NAME"] = "ray"
    env.setdefault("OMP_NUM_THREADS", "1" if not p.with_gpus else "4")
    need = {"GPU": float(per_node), "CPU": 1.0} if p.with_gpus else {"CPU": float(per_node)}
    p.strategy = "STRICT_SPREAD" if nnodes > 1 else "STRICT_PACK"
    p.processes.append(
        RayProcess(
            role="trainer",
            index=0,
            argv=argv,
            env=env,
            gpus=[],
            log_path=str(Path(p.log_dir) / "torchrun-{node}.log"),
            nodes=nnodes,
            resources=need,
        )
    )


def check_feasible(p: RayPlan, nodes) -> None:
    """What no node of the cluster could ever hold, however long one waits: exit 2 now,
    naming what is missing and what each node has."""
    from areal_cli.schedulers.ray import cluster

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
