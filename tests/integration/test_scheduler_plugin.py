"""A scheduler from outside areal: this module alone is the toy scheduler, registered by one
line in the environment (AREAL_SCHEDULERS=toy=MODULE:CLASS), and `areal serve`, `ps` and
`stop` run through it as through the built-in ones.

The toy runs each server replica's runner (launchers/replica.py) as a detached process of this
host and keeps one JSON record per trial under AREAL_HOME/toy.
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
import pytest

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
from areal_cli.spec import Plan, ProcessPlan
from tests.helpers import FAKE_PYTHON, REPO, areal


class ToyScheduler(Scheduler):
    name = "toy"
    label = "Toy"
    runopts = (RunOpt("note", "str", "a word the toy keeps in its record"),)

    def __init__(self, home: Path | None = None, registry: str | None = None):
        self.home = Path(home or settings.home())
        self.registry = registry
        self._stop = threading.Event()

    def _path(self, experiment: str, trial: str) -> Path:
        return self.home / "toy" / experiment / trial / "job.json"

    def dryrun(self, spec, check_packages: bool = False) -> Request:
        role = spec.servers
        if role is None or spec.trainer is not None:
            raise UsageError("the toy scheduler only serves")
        backend = backends.get(role.backend)
        key = resolve_api_key(spec.api_key)
        plan = Plan(
            experiment=spec.experiment, trial=spec.trial, kind=spec.kind,
            log_dir=str(settings.log_dir(self.home, spec.experiment, spec.trial)),
            registry=open_registry(settings.registry_url(self.registry)).url,
            marker=new_marker(spec.experiment, spec.trial), home=str(self.home),
            alloc=spec.alloc, api_key=key, health_timeout=spec.health_timeout,
            api_key_file=str(apikeys.key_file(self.home, spec.experiment, spec.trial)) if key
            else None, model_path=role.model_path, scheduler=self.name,
        )  # fmt: skip
        for i in range(role.replicas):
            plan.processes.append(ProcessPlan(
                role="server", index=i, argv=backend.argv(role, PORT_TOKEN, key, on_gpu=False),
                env=backend.env(role, key, on_gpu=False), gpus=[],
                log_path=f"{plan.log_dir}/server-{i}.log", host=role.host,
                backend=role.backend, health_path=backend.health_path,
            ))  # fmt: skip
        plan.note = spec.scheduler_opts.note  # type: ignore[attr-defined]
        return Request(self.name, spec, plan)

    def schedule(self, request, *, detach, on_event=None, on_line=None, on_progress=None):
        plan = request.plan
        run = self._path(plan.experiment, plan.trial).parent
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
        for p in plan.servers:
            with open(run / f"runner-{p.index}.out", "ab") as out:
                pids.append(subprocess.Popen(
                    [sys.executable, "-m", "areal_cli.launchers.replica", str(run / "plan.json"),
                     "--index", str(p.index)], env=env, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True,
                ).pid)  # fmt: skip
        rec = {"experiment": plan.experiment, "trial": plan.trial, "kind": plan.kind,
               "marker": plan.marker, "pids": pids, "started": time.time(), "state": "running",
               "log_dir": plan.log_dir, "registry": plan.registry, "note": plan.note,
               "replicas": len(plan.servers), "model": plan.model_path,
               "api_key_file": plan.api_key_file}  # fmt: skip
        self._path(plan.experiment, plan.trial).write_text(json.dumps(rec))
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

    def _load(self, experiment: str, trial: str) -> dict | None:
        try:
            return json.loads(self._path(experiment, trial).read_text())
        except (OSError, ValueError):
            return None

    def find(self, experiment, trial, kind=None):
        rec = self._load(experiment, trial)
        if rec is None or kind not in (None, rec["kind"]):
            return []
        return [Handle(self.name, experiment, trial, rec["kind"], rec["marker"][-8:])]

    def describe(self, handle):
        rec = self._load(handle.experiment, handle.trial)
        if rec is None:
            return None
        from areal_cli import discovery

        live = rec["state"] == "running" and any(procs.pid_alive(p) for p in rec["pids"])
        entries = []
        if live:
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
        for path in (self.home / "toy").glob("*/*/job.json"):
            exp, trial = path.parent.parent.name, path.parent.name
            for h in self.find(exp, trial):
                job = self.describe(h)
                if job is not None and (include_ended or job.state == "running"):
                    out.append(job)
        return out

    def log_iter(self, handle, role=None, index=None, follow=False, lines=50):
        rec = self._load(handle.experiment, handle.trial)
        yield from logfiles.Follower(Path(rec["log_dir"]), role, index, history=lines).poll()

    def cancel(self, handle, timeout=30.0):
        rec = self._load(handle.experiment, handle.trial)
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
        self._path(handle.experiment, handle.trial).write_text(json.dumps(rec))
        return StopResult(f"{handle.experiment}/{handle.trial}", was, killed, gone)


PLUGIN = {
    "AREAL_SCHEDULERS": "toy=tests.integration.test_scheduler_plugin:ToyScheduler",
    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
}


def test_a_scheduler_from_one_module_serves_lists_and_stops(tmp_path, areal_env):
    from areal_cli.modelgen import create_tiny_model

    model = create_tiny_model(tmp_path / "tiny")
    res = areal("serve", "--scheduler", "toy", "--scheduler-opt", "note=hello", "--backend",
                "hf", "--model", str(model), "--alloc", "hf:d2", "--python", FAKE_PYTHON,
                "--detach", "--json", env=PLUGIN, check=0, timeout=120)  # fmt: skip
    out = json.loads(res.stdout)
    assert out["scheduler"] == "toy" and len(out["servers"]) == 2
    assert "(Toy job" not in res.stdout  # --json: nothing but the JSON
    (job,) = json.loads(areal("ps", "--json", env=PLUGIN, check=0).stdout)
    assert job["scheduler"] == "toy" and job["message"] == "note: hello"
    assert all(s["healthy"] for s in job["servers"])
    # An option the toy does not declare is refused, naming the ones it has.
    bad = areal("serve", "--scheduler", "toy", "--partition", "gpu", "--backend", "hf",
                "--model", str(model), env=PLUGIN, check=2)  # fmt: skip
    assert "--partition: not an option of the toy scheduler" in bad.stderr
    assert "note" in bad.stderr
    stop = areal("stop", "default/trial0", env=PLUGIN, check=0)
    assert "stopped" in stop.stdout
    assert procs.find_marked(out["marker"]) == []
    (job,) = json.loads(areal("ps", "--all", "--json", env=PLUGIN, check=0).stdout)
    assert job["state"] == "stopped"


@pytest.mark.parametrize("target", ["os:system", "json:JSONDecodeError", "os:sep"])
def test_an_entry_that_is_not_a_scheduler_class_is_refused_naming_it(target, areal_env):
    # A function, a class of another kind, a plain value: each a clear exit 2, never the
    # TypeError of calling it with the scheduler's options.
    entry = f"mine={target}"
    env = {**PLUGIN, "AREAL_SCHEDULERS": entry}
    for args in (("stop", "e/t"), ("serve", "--scheduler", "mine", "--backend", "hf",
                                    "--model", "m", "--dry-run")):  # fmt: skip
        res = areal(*args, env=env, check=2)
        assert "Traceback" not in res.stderr
        assert f"AREAL_SCHEDULERS entry '{entry}'" in res.stderr
        assert "is not a scheduler class" in res.stderr


def test_an_entry_whose_module_fails_to_import_is_refused_naming_it(tmp_path, areal_env):
    (tmp_path / "broken_sched.py").write_text("raise RuntimeError('no cluster here')\n")
    env = {"AREAL_SCHEDULERS": "b=broken_sched:X", "PYTHONPATH": str(tmp_path)}
    res = areal("stop", "e/t", env=env, check=2)
    assert "Traceback" not in res.stderr
    assert "AREAL_SCHEDULERS entry 'b=broken_sched:X'" in res.stderr
    assert "RuntimeError: no cluster here" in res.stderr


def test_replacing_a_built_in_scheduler_says_so_in_one_line(areal_env):
    home = areal_env[0]
    (home / "jobs").mkdir(parents=True)  # so that `ps` loads the local scheduler
    toy = PLUGIN["AREAL_SCHEDULERS"].partition("=")[2]
    res = areal("ps", env={**PLUGIN, "AREAL_SCHEDULERS": f"local={toy}"}, check=0)
    warned = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert warned == [
        f"warning: AREAL_SCHEDULERS: 'local={toy}' replaces the built-in 'local' scheduler "
        "(areal_cli.schedulers.local:LocalScheduler)"
    ], res.stderr
    assert "Traceback" not in res.stderr
    # A new name, or a built-in named as itself, replaces nothing: no warning.
    same = "local=areal_cli.schedulers.local:LocalScheduler"
    for value in (PLUGIN["AREAL_SCHEDULERS"], same):
        quiet = areal("ps", env={**PLUGIN, "AREAL_SCHEDULERS": value}, check=0)
        assert "warning" not in quiet.stderr, quiet.stderr
