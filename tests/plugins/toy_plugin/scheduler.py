"""The toy scheduler: every process of a job a detached process of this host, one JSON record
per job under AREAL_HOME/toy (its own folder). Servers run under areal's replica runner
(launchers/replica.py), which registers them; trainers are what the local scheduler's
planner plans (torchrun under launchers/torchrun.py). Only areal's public modules are used.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from areal_cli import apikeys, backends, logfiles, procs, settings
from areal_cli.errors import LaunchError, UsageError
from areal_cli.launchers.replica import PORT_TOKEN
from areal_cli.registry import open_registry
from areal_cli.schedulers.api import (
    Handle,
    JobStatus,
    Request,
    RunOpt,
    Scheduler,
    ServerStatus,
    Stopped,
    StopResult,
)
from areal_cli.schedulers.common import new_marker, resolve_api_key
from areal_cli.schedulers.local import planner
from areal_cli.spec import Plan, ProcessPlan


class ToyScheduler(Scheduler):
    name = "toy"
    label = "Toy"
    records = "toy"
    # Its flag is a flag of `serve` and `train` wherever this plug-in is installed.
    runopts = (RunOpt("note", "str", "a word the toy keeps in its record", "--toy-note"),)

    def __init__(self, home: Path | None = None, registry: str | None = None):
        self.home = Path(home or settings.home())
        self.registry = registry
        self._stop = threading.Event()

    def _path(self, experiment: str, trial: str, kind: str) -> Path:
        return self.home / self.records / experiment / trial / f"{kind}.json"

    def dryrun(self, spec, check_packages: bool = False) -> Request:
        if spec.servers is not None and spec.trainer is not None:
            raise UsageError("the toy scheduler runs servers and trainers as separate jobs")
        registry = open_registry(settings.registry_url(self.registry))
        if spec.trainer is not None:
            plan = planner.plan(spec, self.home, registry, check_packages=check_packages)
        else:
            plan = self._serve_plan(spec, registry)
        plan.scheduler = self.name
        plan.note = spec.scheduler_opts.note  # type: ignore[attr-defined]
        return Request(self.name, spec, plan)

    def _serve_plan(self, spec, registry) -> Plan:
        role = spec.servers
        backend = backends.get(role.backend)
        key = resolve_api_key(spec.api_key)
        plan = Plan(
            experiment=spec.experiment, trial=spec.trial, kind=spec.kind,
            log_dir=str(settings.log_dir(self.home, spec.experiment, spec.trial)),
            registry=registry.url, marker=new_marker(spec.experiment, spec.trial),
            home=str(self.home), alloc=spec.alloc, api_key=key,
            health_timeout=spec.health_timeout,
            api_key_file=str(apikeys.key_file(self.home, spec.experiment, spec.trial)) if key
            else None, model_path=role.model_path,
        )  # fmt: skip
        for i in range(role.replicas):
            plan.processes.append(ProcessPlan(
                role="server", index=i, argv=backend.argv(role, PORT_TOKEN, key, on_gpu=False),
                env=backend.env(role, key, on_gpu=False), gpus=[],
                log_path=f"{plan.log_dir}/server-{i}.log", host=role.host,
                backend=role.backend, health_path=backend.health_path,
            ))  # fmt: skip
        return plan

    def schedule(self, request, *, detach, on_event=None, on_line=None, on_progress=None):
        plan = request.plan
        run = self._path(plan.experiment, plan.trial, plan.kind).parent / plan.kind
        run.mkdir(parents=True, exist_ok=True)
        settings.ensure_dir(plan.log_dir)
        for old in run.glob("server-*.ready"):
            old.unlink()
        data = {**plan.to_json(redact=False), "run_dir": str(run)}
        (run / "plan.json").write_text(json.dumps(data))
        (run / "plan.json").chmod(0o600)
        if plan.api_key and plan.api_key_file:
            apikeys.store(plan.api_key_file, plan.marker, plan.api_key)
        env = {**os.environ, procs.MARKER_ENV: plan.marker}
        pids = []
        for p in plan.processes:
            if p.role == "server":
                argv = [sys.executable, "-m", "areal_cli.launchers.replica",
                        str(run / "plan.json"), "--index", str(p.index)]  # fmt: skip
                out_path = run / f"runner-{p.index}.out"
            else:
                argv, out_path = p.argv, Path(p.log_path)
            with open(out_path, "ab") as out:
                pids.append(subprocess.Popen(
                    argv, env={**env, **(p.env if p.role != "server" else {})}, stdout=out,
                    stderr=subprocess.STDOUT, start_new_session=True,
                ).pid)  # fmt: skip
        rec = {"experiment": plan.experiment, "trial": plan.trial, "kind": plan.kind,
               "marker": plan.marker, "pids": pids, "started": time.time(), "state": "running",
               "log_dir": plan.log_dir, "registry": plan.registry, "note": plan.note,
               "model": plan.model_path}  # fmt: skip
        self._path(plan.experiment, plan.trial, plan.kind).write_text(json.dumps(rec))
        handle = Handle(self.name, plan.experiment, plan.trial, plan.kind, plan.marker[-8:])
        deadline = time.monotonic() + plan.health_timeout
        while len(list(run.glob("server-*.ready"))) < len(plan.servers):
            if not any(procs.pid_alive(pid) for pid in pids) or time.monotonic() > deadline:
                self.cancel(handle)
                raise LaunchError("the toy's servers did not become ready")
            time.sleep(0.05)
        if not detach:
            self._stop.wait()
            self.cancel(handle)
            raise Stopped(130)
        return handle

    def request_stop(self, signum: int = 2) -> None:
        self._stop.set()

    def _load(self, experiment: str, trial: str, kind: str) -> dict | None:
        try:
            return json.loads(self._path(experiment, trial, kind).read_text())
        except (OSError, ValueError):
            return None

    def find(self, experiment, trial, kind=None):
        out = []
        for k in ("serve", "train") if kind is None else (kind,):
            rec = self._load(experiment, trial, k)
            if rec is not None:
                out.append(Handle(self.name, experiment, trial, k, rec["marker"][-8:]))
        return out

    def describe(self, handle):
        rec = self._load(handle.experiment, handle.trial, handle.kind)
        if rec is None:
            return None
        from areal_cli import discovery

        live = rec["state"] == "running" and any(procs.pid_alive(p) for p in rec["pids"])
        entries = []
        if live and handle.kind == "serve":
            entries = [e for e in open_registry(rec["registry"])
                       .list(rec["experiment"], rec["trial"]).servers
                       if e.marker == rec["marker"]]  # fmt: skip
        health = discovery.healthy([e.addr for e in entries])
        return JobStatus(
            handle=handle, state="running" if live else "stopped", host=settings.hostname(),
            pids=rec["pids"], started=rec["started"], log_dir=rec["log_dir"],
            servers=[ServerStatus(addr=e.addr, healthy=bool(health.get(e.addr)), pid=e.pid,
                                  node=e.node) for e in entries],
            marker=rec["marker"], registry=rec["registry"], model=rec["model"],
            message=f"note: {rec['note']}" if rec.get("note") else None,
        )  # fmt: skip

    def list(self, include_ended=False):
        out = []
        for path in (self.home / self.records).glob("*/*/*.json"):
            exp, trial = path.parent.parent.name, path.parent.name
            for h in self.find(exp, trial, path.stem):
                job = self.describe(h)
                if job is not None and (include_ended or job.state == "running"):
                    out.append(job)
        return out

    def log_iter(self, handle, role=None, index=None, follow=False, lines=50):
        rec = self._load(handle.experiment, handle.trial, handle.kind)
        yield from logfiles.Follower(Path(rec["log_dir"]), role, index, history=lines).poll()

    def cancel(self, handle, timeout=30.0):
        rec = self._load(handle.experiment, handle.trial, handle.kind)
        was = rec["state"] == "running"
        for pid in rec["pids"]:
            try:
                os.killpg(pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        psutil.wait_procs([psutil.Process(p) for p in rec["pids"] if psutil.pid_exists(p)],
                          timeout=timeout)  # fmt: skip
        killed = procs.kill_job(rec["marker"], grace=3.0)
        gone = open_registry(rec["registry"]).deregister_job(
            rec["experiment"], rec["trial"], rec["marker"]
        )
        rec["state"] = "stopped"
        self._path(handle.experiment, handle.trial, handle.kind).write_text(json.dumps(rec))
        return StopResult(f"{handle.experiment}/{handle.trial}", was, killed, gone)
