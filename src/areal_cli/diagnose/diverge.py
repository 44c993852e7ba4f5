"""`areal doctor diverge`: ask a live job's ranks to compare their tensors at a step to come.

Every rank must enter the check's collectives at the same step, so the doctor names one:
it reads each rank's last step (ctx.progress) twice to see how fast steps go, picks a step
about a second ahead of the furthest rank, and arms it on every rank. A rank arms it only
while it has not reached that step; if any rank is past it, the request is cancelled on all
and tried again further ahead. The ranks then run areal_cli.worker.check_consistency from
their main threads at that step and keep the report until the doctor fetches it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from areal_cli.diagnose.targets import Job
from areal_cli.errors import ArealError, UsageError, WaitTimeout
from areal_cli.worker import channel


@dataclass
class DivergeResult:
    job: str
    step: int
    report: dict
    ranks: list[int]
    not_reached: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict:
        # "seconds" is the check's own time (in the report); wall_s the doctor's.
        return {"job": self.job, "step": self.step, "ranks": self.ranks,
                "not_reached": self.not_reached, "wall_s": round(self.seconds, 3),
                **self.report}  # fmt: skip


def _ask_all(pids: dict[int, int], op: str, timeout: float = 5.0, **args) -> dict[int, dict]:
    from concurrent.futures import ThreadPoolExecutor

    def one(pid: int):
        try:
            return channel.ask(pid, op, timeout=timeout, **args)
        except channel.ChannelError as e:
            return e

    with ThreadPoolExecutor(max_workers=min(32, len(pids) or 1)) as ex:
        got = dict(zip(pids, ex.map(one, pids.values()), strict=True))
    return got


def run(job: Job, *, timeout: float = 60.0, lead_s: float = 1.0) -> DivergeResult:
    t0 = time.monotonic()
    pids = {r.rank if r.rank is not None else i: r.pid for i, r in enumerate(job.ranks)}
    first = _ask_all(pids, "progress")
    _raise_unanswered(first, job)
    steps = {r: a["step"] for r, a in first.items()}
    if any(s is None for s in steps.values()):
        silent = sorted(r for r, s in steps.items() if s is None)
        raise UsageError(
            f"rank(s) {silent} of {job.label} report no step",
            hint="the training loop must call ctx.progress(step) once per step",
        )
    time.sleep(0.25)
    again = _ask_all(pids, "progress")
    _raise_unanswered(again, job)
    rate = max(0, max(a["step"] for a in again.values()) - max(steps.values())) / 0.25
    margin = 1 + math.ceil(rate * lead_s)
    for _attempt in range(3):
        target = max(a["step"] for a in again.values()) + margin
        armed = _ask_all(pids, "diverge_arm", step=target)
        _raise_unanswered(armed, job)
        if all(a["armed"] for a in armed.values()):
            break
        _ask_all(pids, "diverge_cancel", step=target)
        margin *= 4
        again = _ask_all(pids, "progress")
    else:
        raise ArealError(f"the ranks of {job.label} outran every step named to them")
    deadline = time.monotonic() + timeout
    results: dict[int, dict] = {}
    while time.monotonic() < deadline and len(results) < len(pids):
        wait = min(2.0, max(0.05, deadline - time.monotonic()))
        pending = {r: p for r, p in pids.items() if r not in results}
        got = _ask_all(pending, "diverge_result", timeout=wait + 5, step=target, wait=wait)
        for r, a in got.items():
            if isinstance(a, channel.ChannelError):
                results[r] = {"done": False, "error": str(a)}
            elif a.get("done") or a.get("error"):
                results[r] = a
    missing = sorted(r for r in pids if not results.get(r, {}).get("done"))
    done = [r for r in sorted(pids) if results.get(r, {}).get("done")]
    if not done:
        # Left armed on purpose: withdrawing it now could reach some ranks after the others
        # entered the check, and those would wait in its collectives for ever.
        now = _ask_all(pids, "progress")
        where = {r: a["step"] for r, a in now.items() if isinstance(a, dict)}
        raise WaitTimeout(
            f"no rank of {job.label} reached step {target} within {timeout:g}s (steps now "
            f"{where}); the check stays armed and runs if they get there",
            hint="a job that stopped stepping may hang: areal doctor hang",
        )
    report = results[done[0]]["report"]
    return DivergeResult(job.name or job.label, target, report, sorted(pids), missing,
                         time.monotonic() - t0)  # fmt: skip


def _raise_unanswered(answers: dict, job: Job) -> None:
    bad = {r: a for r, a in answers.items() if isinstance(a, channel.ChannelError)}
    if bad:
        first = next(iter(bad.values()))
        raise UsageError(
            f"rank(s) {sorted(bad)} of {job.label} do not answer the doctor's channel: {first}",
            hint="the ranks must run on areal's worker runtime (areal_cli.worker.connect())",
        )
