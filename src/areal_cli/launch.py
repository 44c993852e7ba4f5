"""Running a plan: in the foreground (the caller's process supervises) or detached (a daemon
supervises and we return once the job is ready)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from areal_cli import jobs, procs, settings
from areal_cli.errors import EXIT_TIMEOUT, LaunchError, WaitTimeout
from areal_cli.spec import Plan


def spawn_detached(plan: Plan, home: Path) -> subprocess.Popen:
    """Start `python -m areal_cli.supervisor` in a session of its own."""
    jobs.refuse_if_running(home, plan.experiment, plan.trial, plan.kind)
    job_dir = jobs.record_path(home, plan.experiment, plan.trial, plan.kind).parent
    settings.ensure_dir(job_dir)
    settings.ensure_dir(plan.log_dir)
    plan_file = job_dir / f".{jobs.slot(plan.kind)}-plan.json"
    # The plan may hold the API key: readable by the user only.
    fd = os.open(plan_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(plan.to_json(redact=False), f)
    log = open(supervisor_log(plan), "wb")  # noqa: SIM115 - handed to the child
    env = {k: v for k, v in os.environ.items() if k != procs.MARKER_ENV}
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "areal_cli.supervisor", str(plan_file), "--home", str(home)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    finally:
        log.close()


def wait_detached(
    plan: Plan,
    home: Path,
    daemon: subprocess.Popen,
    on_progress: Callable[[jobs.JobRecord | None], None] | None = None,
) -> jobs.JobRecord:
    """Block until the detached job is running (or trained to its end), or failed."""
    deadline = time.monotonic() + plan.health_timeout + 30
    while True:
        rec = _read(home, plan)
        if on_progress:
            on_progress(rec)
        if rec and rec.marker == plan.marker:
            if rec.state == "running":
                return rec
            if rec.state in ("failed", "killed", "stopped"):
                cls = WaitTimeout if rec.exit_code == EXIT_TIMEOUT else LaunchError
                raise cls(
                    rec.message or f"job {rec.name} ended ({rec.state})",
                    detail=rec.detail,
                    hint=f"logs: {plan.log_dir} (areal logs {rec.name})",
                )
        code = daemon.poll()
        if code is not None and (rec is None or rec.state not in ("running",)):
            rec = _read(home, plan)
            if rec and rec.marker == plan.marker and rec.state != "starting":
                continue
            tail = _tail(supervisor_log(plan))
            raise LaunchError(
                f"the job's supervisor exited ({code}) before the job was ready",
                detail=tail,
                hint=f"full log: {supervisor_log(plan)}",
            )
        if time.monotonic() > deadline:
            raise WaitTimeout(f"job {plan.experiment}/{plan.trial} not ready in time")
        time.sleep(0.02)


def supervisor_log(plan: Plan) -> Path:
    return Path(plan.log_dir) / f"supervisor-{jobs.slot(plan.kind)}.log"


def _read(home: Path, plan: Plan) -> jobs.JobRecord | None:
    try:
        return jobs.load(home, plan.experiment, plan.trial, plan.kind)
    except Exception:
        return None


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""
