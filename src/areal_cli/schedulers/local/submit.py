"""Planning and starting a local job (LocalScheduler.dryrun, schedule, request_stop): the
planner, the detached launch and the foreground supervisor. Kept apart from the package so
that `areal ps` imports none of them."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from areal_cli.errors import UsageError
from areal_cli.registry import open_registry
from areal_cli.schedulers.api import Handle, Request, Stopped
from areal_cli.schedulers.local import launch, planner, records
from areal_cli.schedulers.local.supervisor import EXIT_TERMINATED, Supervisor

if TYPE_CHECKING:
    from areal_cli.schedulers.local import LocalScheduler
    from areal_cli.spec import JobSpec


def dryrun(sched: LocalScheduler, spec: JobSpec, check_packages: bool) -> Request:
    plan = planner.plan(spec, sched.home, sched.opened_registry(), check_packages=check_packages)
    return Request(sched.name, spec, plan)


def schedule(sched: LocalScheduler, request: Request, detach: bool, callbacks: dict) -> Handle:
    """LocalScheduler.schedule; `callbacks`: Scheduler.schedule's on_event, on_line and
    on_progress, those given."""
    on_progress = callbacks.get("on_progress")
    plan = request.plan
    if plan.servers:
        _check_registry(plan.registry)
    claim = records.Claim.take(sched.home, plan)
    handle = Handle(sched.name, plan.experiment, plan.trial, plan.kind)
    if detach:
        try:
            daemon = launch.spawn_detached(plan, sched.home, claim)
        except BaseException:
            claim.release()
            raise
        claim.handed_over()
        n = len(plan.servers)

        def progress(rec) -> None:
            if on_progress and rec is not None and rec.marker == plan.marker:
                on_progress(f"{rec.state}, {len(rec.processes)}/{n} spawned")

        try:
            launch.wait_detached(plan, sched.home, daemon, progress)
        except KeyboardInterrupt:
            # Ctrl-C while waiting means "never mind": the starting job goes too.
            daemon.terminate()
            daemon.wait()
            raise
        return handle
    sup = Supervisor(plan, sched.home, claim, on_event=callbacks.get("on_event"),
                     on_line=callbacks.get("on_line"), registry=sched.opened_registry())  # fmt: skip
    sched._foreground = sup
    code = sup.supervise()
    if code:
        raise Stopped(code)
    return handle


def request_stop(supervisor: Supervisor, signum: int) -> None:
    """A foreground job asked to stop: Ctrl-C is "interrupted", anything else "terminated"."""
    if signum == signal.SIGINT:
        supervisor.request_stop("interrupted")
    else:
        supervisor.request_stop("terminated", EXIT_TERMINATED)


def _check_registry(url: str) -> None:
    """Servers are only useful once registered: a registry we cannot write (another user's
    folder, a read-only path, etcd refusing us) is a usage error before anything starts."""
    try:
        open_registry(url).probe()
    except OSError as e:
        raise UsageError(
            f"cannot write the registry at {url}: {e.strerror or e}",
            hint="pick a writable --registry (or AREAL_REGISTRY)",
        ) from None
