"""Scheduler.plan for one host: turn a JobSpec into concrete processes.

Assigns CUDA_VISIBLE_DEVICES slices, ports, log paths, the API key and each process's
environment. Checks what can be checked without starting anything (GPUs, ports, packages),
so `--dry-run` shows exactly what would run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from areal_cli import apikeys, backends, gpus, procs, settings
from areal_cli.errors import UsageError
from areal_cli.launchers import torchrun
from areal_cli.registry import Registry
from areal_cli.schedulers.common import (
    external_servers,
    opened,
    plan_fields,
    resolve_api_key,
    script_args,
    worker_env,
)
from areal_cli.schedulers.local import records
from areal_cli.spec import JobSpec, Plan, ProcessPlan, ServerRole, TrainerRole


def held_by_others(
    registry: Registry, home: Path, inventory: gpus.GpuInventory | None = None
) -> tuple[dict[int, str], set[int]]:
    """GPUs (index → who) and ports that live jobs on this host hold: every user's
    registered servers, every process of our live job records (servers still loading,
    trainers), and whatever nvidia-smi shows running on a GPU (other users' jobs too)."""
    me = settings.hostname()
    gpus_: dict[int, str] = {}
    ports: set[int] = set()
    for user in dict.fromkeys([registry.user, *registry.users()]):
        try:
            entries = (
                registry.for_user(user).list().servers
                if user != registry.user
                else registry.list().servers
            )
        except Exception:
            continue  # another user's tree we may not read
        who = "" if user == registry.user else f"user {user}: "
        for e in entries:
            if e.host == me:
                for g in e.gpus:
                    gpus_.setdefault(g, f"{who}{e.experiment}/{e.trial} {e.addr}")
    if inventory is not None:
        for g, who in gpus.busy(inventory).items():
            gpus_.setdefault(g, who)
    for rec in records.list_all(home)[0]:
        if rec.host != me or rec.state not in records.LIVE or not rec.alive():
            continue
        for p in rec.processes:
            for g in p.gpus:
                gpus_.setdefault(g, f"{rec.name} {p.addr or p.role}")
            if p.addr:
                ports.add(int(p.addr.rpartition(":")[2]))
    return gpus_, ports


def plan(spec: JobSpec, home: Path, registry: Registry | str, check_packages: bool = True) -> Plan:
    registry = opened(registry)
    p = Plan(**plan_fields(spec, home, registry))
    log_dir = Path(p.log_dir)
    inventory = gpus.detect(spec.gpus_flag)
    held, busy_ports = held_by_others(registry, home, inventory)
    free = [g for g in inventory.ids if g not in held]

    if spec.servers:
        role = spec.servers
        key = resolve_api_key(spec.api_key)
        if key:
            p.api_key = key
            p.api_key_file = str(apikeys.key_file(home, spec.experiment, spec.trial))
        free = _plan_servers(p, role, inventory, free, held, log_dir, check_packages, busy_ports)
        # As the user gave it (a hub id stays a hub id), for the registry and `areal ps`.
        p.model_path = role.model_path + (f"@{role.revision}" if role.revision else "")
        p.tp = role.tp
    if spec.trainer:
        _plan_trainer(p, spec, spec.trainer, inventory, free, held, log_dir, registry)
    return p


def _plan_servers(p, role: ServerRole, inventory, free, held, log_dir, check_packages, busy_ports):
    backend = backends.get(role.backend)
    backend.check_bind(role)
    on_gpu = bool(inventory.gpus)
    need = role.replicas * role.gpus_per_replica
    if not on_gpu and not backend.runs_on_cpu:
        raise UsageError(
            f"{role.backend} needs GPUs and this host has none ({_source(inventory)})",
            hint="the hf backend runs on CPU: --backend hf; or pass --gpus 0,1,...",
        )
    if not backend.multi_gpu_replica and role.gpus_per_replica != 1:
        raise UsageError(
            f"the {backend.name} backend runs one replica per GPU (t1p1)",
            hint=f"use d to add replicas, e.g. --alloc {backend.name}:d2",
        )
    if on_gpu and need > len(free):
        raise UsageError(
            f"the plan needs {need} GPUs ({role.replicas} replicas x {role.gpus_per_replica}), "
            f"but only {len(free)} are free ({_source(inventory)}: {inventory.ids})"
            + _held_text(held),
            hint="lower d/t, or pass --gpus with more devices",
        )
    if check_packages:
        backends.check_installed(backend, role.python, on_gpu=on_gpu)
    ports = _ports(role, role.replicas, busy_ports)
    # Without GPUs, an engine's CPU build runs: each replica on cores of its own.
    cores = backends.cpu_slices(role.replicas) if not on_gpu and backend.needs_gpu else None
    if cores:
        p.notes.append(
            f"no GPU here ({_source(inventory)}): planned {role.backend}'s CPU build; "
            "--gpus 0,1,... plans for GPUs"
        )
    for i in range(role.replicas):
        slice_ = free[i * role.gpus_per_replica : (i + 1) * role.gpus_per_replica] if on_gpu else []
        cpus = cores[i] if cores else []
        env = {
            "CUDA_VISIBLE_DEVICES": inventory.visible(slice_) if on_gpu else "",
            "PYTHONUNBUFFERED": "1",
            **backend.env(role, p.api_key, on_gpu=on_gpu, cores=cpus),
        }
        p.processes.append(
            ProcessPlan(
                role="server",
                index=i,
                argv=backend.argv(role, ports[i], p.api_key, on_gpu),
                env=env,
                gpus=slice_,
                log_path=str(log_dir / f"server-{i}.log"),
                host=role.host,
                port=ports[i],
                backend=role.backend,
                health_path=backend.health_path,
                cpus=cpus,
                first_request=backend.first_request(role),
            )
        )
    return free[need:] if on_gpu else free


def _plan_trainer(p, spec: JobSpec, t: TrainerRole, inventory, free, held, log_dir, registry):
    on_gpu = bool(inventory.gpus)
    if on_gpu and t.nproc > len(free):
        raise UsageError(
            f"training needs {t.nproc} GPUs on this node but only {len(free)} are free "
            f"({_source(inventory)}: {inventory.ids})" + _held_text(held),
            hint="stop servers you do not need (areal ps), lower the fsdp world size or pass --gpus",
        )
    cap = int(os.environ.get("AREAL_MAX_CPU_RANKS", max(8, os.cpu_count() or 1)))
    if not on_gpu and t.nproc > cap:
        raise UsageError(
            f"{t.nproc} ranks on CPU is more than this host allows ({cap}, no GPU found)",
            hint="lower d/t/c, or set AREAL_MAX_CPU_RANKS if you really mean it",
        )
    slice_ = free[: t.nproc] if on_gpu else []
    if p.servers:
        addrs = [s.addr for s in p.servers]
        backend, key = p.servers[0].backend, p.api_key
    else:
        addrs, backend, key = external_servers(p, spec)
    args = script_args(spec, backend, len(addrs), registry)
    if t.nnodes == 1 and t.master_port is None:
        rdzv = torchrun.Rendezvous()  # the OS picks the port: no race with other jobs
    else:
        endpoint = f"{t.master_addr}:{t.master_port or torchrun.DEFAULT_PORT}"
        rdzv = torchrun.Rendezvous(t.nnodes, t.node_rank, endpoint, backend="static")
    argv = torchrun.argv(
        t.python or sys.executable,
        t.nproc,
        [t.script, *args],
        rendezvous=rdzv,
        log_dir=Path(p.log_dir) / "torchrun",
    )
    p.processes.append(
        ProcessPlan(
            role="trainer",
            index=0,
            argv=argv,
            env=worker_env(spec, t, p, addrs, backend, key, inventory.visible(slice_)),
            gpus=slice_,
            log_path=str(log_dir / "torchrun.log"),
        )
    )


def _ports(role: ServerRole, n: int, busy: set[int]) -> list[int]:
    if role.port_base is None:
        # Servers bind their port only after loading the model: ports of jobs still
        # starting are taken too, though nothing listens on them yet.
        start = settings.port_base(procs.DEFAULT_PORT_BASE)
        return procs.free_ports(n, role.host, start=start, avoid=busy)
    ports = list(range(role.port_base, role.port_base + n))
    for port in ports:
        if port > 65535:
            raise UsageError(f"port {port} is out of range", hint="pick a lower --port-base")
        if port in busy:
            raise UsageError(
                f"port {port} (--port-base {role.port_base}) belongs to a job still starting",
                hint="see `areal ps`, or pick another --port-base",
            )
        if not procs.port_free(port, role.host):
            who = procs.port_holder(port) or "another process"
            raise UsageError(
                f"port {port} (--port-base {role.port_base}) is in use by {who}",
                hint="stop that process or pick another --port-base; without it free ports are found",
            )
    return ports


def _source(inv) -> str:
    return {"none": "no --gpus, no CUDA_VISIBLE_DEVICES, no nvidia-smi"}.get(
        inv.source, f"from {inv.source}"
    )


def _held_text(held: dict[int, str]) -> str:
    if not held:
        return ""
    parts = [f"GPU {g}: {who}" for g, who in sorted(held.items())]
    return "; held by: " + "; ".join(parts)
