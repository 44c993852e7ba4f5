"""What the planners of the cluster schedulers (Slurm, Ray) compute the same way: the plan's
run folder, each server replica's role and process (bound to its node's address, not
loopback), and the torchrun every training node runs with the workers' environment. Each
planner adds its own placement (Slurm's components and steps, Ray's actors and placement group)
and its checks against the cluster.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

from areal_cli import apikeys, backends
from areal_cli.errors import UsageError
from areal_cli.launchers import torchrun
from areal_cli.launchers.node import NODE_ADDR
from areal_cli.registry import Registry
from areal_cli.schedulers.common import (
    external_servers,
    plan_fields,
    resolve_api_key,
    script_args,
    worker_env,
)
from areal_cli.schedulers.job_records import slot
from areal_cli.spec import JobSpec, Plan, ProcessPlan, ServerRole


class ClusterPlan(Plan):
    """A plan whose processes each say where on the cluster they run (`placement`)."""

    process_type: ClassVar[type] = ProcessPlan

    def to_json(self, redact: bool = True) -> dict:
        d = super().to_json(redact)
        d["placement"] = {
            f"{p.role}-{p.index}" if p.role == "server" else "torchrun": p.placement
            for p in self.processes
        }
        return d

    @classmethod
    def from_json(cls, d: dict):
        d = {k: v for k, v in d.items() if k != "placement"}
        d["processes"] = [cls.process_type(**p) for p in d.get("processes", [])]
        return cls(**d)


def cluster_fields(spec: JobSpec, home: Path, registry: Registry, trial_dir: Path) -> dict:
    """plan_fields, and the run folder of this start in the scheduler's folder of the trial
    (on the filesystem every node shares): the private plan, the runners' exit codes."""
    d = plan_fields(spec, home, registry)
    d["run_dir"] = str(trial_dir / f"{slot(spec.kind)}-{d['marker'][-8:]}")
    return d


def server_role(spec: JobSpec) -> tuple[ServerRole, backends.Backend]:
    """The servers' role as the cluster runs it, and their backend. Other nodes must reach
    the servers: a loopback bind becomes the node's own address, found by the runner there."""
    role = spec.servers
    backend = backends.get(role.backend)
    if backends.is_loopback(role.host):
        role = replace(role, host=NODE_ADDR)
    backend.check_bind(role)
    if not backend.multi_gpu_replica and role.gpus_per_replica != 1:
        raise UsageError(
            f"the {backend.name} backend runs one replica per GPU (t1p1): it cannot span GPUs "
            "or nodes",
            hint=f"use d to add replicas, e.g. --alloc {backend.name}:d2",
        )
    return role, backend


def server_key(p: Plan, spec: JobSpec) -> str | None:
    """The servers' API key (the plan holds it, the key file of the trial keeps it)."""
    key = resolve_api_key(spec.api_key)
    if key:
        p.api_key = key
        p.api_key_file = str(apikeys.key_file(Path(p.home), spec.experiment, spec.trial))
    return key


def replica_fields(p: Plan, role: ServerRole, backend, i: int, argv: list[str], env) -> dict:
    """Replica i's process, but for where it runs: its port is chosen on its node, and the
    API key is in its environment (the plan file is private), never in argv. Ready means its
    first generation was answered, on every scheduler (an engine can pass /health and die on
    its first forward pass)."""
    return dict(
        role="server", index=i, argv=argv, env={"PYTHONUNBUFFERED": "1", **env}, gpus=[],
        log_path=str(Path(p.log_dir) / f"server-{i}.log"), host=role.host, port=None,
        backend=role.backend, health_path=backend.health_path,
        first_request=backend.first_request(role),
    )  # fmt: skip


def served(p: Plan, role: ServerRole) -> None:
    """What the plan says of the model its servers serve (as given: a hub id stays one)."""
    p.model_path = role.model_path + (f"@{role.revision}" if role.revision else "")
    p.tp = role.tp


def trainer_fields(p: Plan, spec: JobSpec, registry: Registry, nnodes: int, nproc: int) -> dict:
    """The trainers' process, but for where it runs: the torchrun each of the `nnodes`
    training nodes runs (`nproc` ranks; several nodes meet at a port the first picks), the
    workers' environment, one log per node. GPUs are bound on the node (no
    CUDA_VISIBLE_DEVICES in the plan)."""
    t = spec.trainer
    env_extra: dict[str, str] = {}
    if spec.servers:
        # Servers of the same job: their addresses exist only once they run. Rank 0 finds
        # them in the registry, as `areal train` does, and tells the other ranks.
        addrs, backend, key = [], spec.servers.backend, None
        env_extra = {
            "AREAL_WAIT_SERVERS": f"{spec.health_timeout:g}",
            "AREAL_MIN_SERVERS": str(spec.servers.replicas),
        }
    else:
        addrs, backend, key = external_servers(p, spec)
    n = spec.servers.replicas if spec.servers else len(addrs)
    args = script_args(spec, backend, n, registry)
    if nnodes == 1:
        rdzv = torchrun.Rendezvous()
    else:
        rdzv = torchrun.Rendezvous(nnodes, endpoint=torchrun.RDZV_TOKEN, backend="c10d")
    script = t.script if t.script == "-m" else str(Path(t.script).resolve())
    argv = torchrun.argv(
        t.python or sys.executable,
        nproc,
        [script, *args],
        rendezvous=rdzv,
        log_dir=Path(p.log_dir) / "torchrun",
    )
    env = worker_env(spec, t, p, addrs, backend, key, visible=None)
    env.update(env_extra)
    env["AREAL_SCHEDULER_NAME"] = p.scheduler
    log_path = str(Path(p.log_dir) / "torchrun-{node}.log")
    return dict(role="trainer", index=0, argv=argv, env=env, gpus=[], log_path=log_path)
