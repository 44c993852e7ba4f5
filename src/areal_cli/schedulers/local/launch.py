"""Detached jobs: a daemon supervises (in a session of its own) and the command returns once
the job is ready. The command takes the trial's slot first and hands the lock to the daemon,
so a second start of the same job is refused at once, whatever the timing."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from areal_cli import logfiles, procs, settings
from areal_cli.errors import EXIT_TIMEOUT, LaunchError, WaitTimeout
from areal_cli.schedulers.local import records
from areal_cli.spec import Plan


def spawn_detached(plan: Plan, home: Path, claim: records.Claim) -> subprocess.Popen:
    """Start the supervisor daemon; it inherits the claim's locks."""
    settings.ensure_dir(plan.log_dir)
    log = os.fdopen(logfiles.fresh_log(supervisor_log(plan)), "wb")  # handed to the child
    env = {k: v for k, v in os.environ.items() if k != procs.MARKER_ENV}
    argv = [sys.executable, "-m", "areal_cli.schedulers.local.supervisor", str(claim.plan_file)]
    argv += ["--home", str(home)]
    for fd in claim.fds:
        argv += ["--slot-fd", str(fd)]
    try:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            pass_fds=claim.fds,
        )
    finally:
        log.close()


def wait_detached(
    plan: Plan,
    home: Path,
    daemon: subprocess.Popen,
    on_progress: Callable[[records.JobRecord | None], None] | None = None,
) -> records.JobRecord:
    """Block until the detached job is running, or failed."""
    deadline = time.monotonic() + plan.health_timeout + 30
    while True:
        rec = _read(home, plan)
        if on_progress:
            on_progress(rec)
        if rec and rec.marker == plan.marker:
            if rec.state == "running":
                return rec
            if rec.state == "stopped" and rec.exit_code == 0 and plan.trainers:
                return rec  # a training job so short it was done before we looked
            if rec.state in ("failed", "killed", "stopped"):
                cls = WaitTimeout if rec.exit_code == EXIT_TIMEOUT else LaunchError
                raise cls(
                    rec.message or f"job {rec.name} ended ({rec.state})",
                    detail=rec.detail,
                    hint=f"logs: {plan.log_dir} (areal logs {rec.name})",
                )
        code = daemon.poll()
        if code is not None:
            rec = _read(home, plan)
            if rec and rec.marker == plan.marker and rec.state != "starting":
                continue
            raise LaunchError(
                f"the job's supervisor exited ({code}) before the job was ready",
                detail="\n".join(logfiles.tail(supervisor_log(plan), 15)),
                hint=f"full log: {supervisor_log(plan)}",
            )
        if time.monotonic() > deadline:
            raise WaitTimeout(f"job {plan.experiment}/{plan.trial} not ready in time")
        time.sleep(0.02)


def supervisor_log(plan: Plan) -> Path:
    return Path(plan.log_dir) / f"supervisor-{records.slot(plan.kind)}.log"


def _read(home: Path, plan: Plan) -> records.JobRecord | None:
    try:
        return records.load(home, plan.experiment, plan.trial, plan.kind)
    except Exception:
        return None
