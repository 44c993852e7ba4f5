"""`areal doctor diverge`: ask a live job's ranks to compare their tensors at a step to come.

Every rank must enter the check's collectives at the same step, so the doctor names one and
arms it in two phases (areal_cli.worker.consistency): each rank accepts the step only while it
has not reached it, and a rank that reaches an accepted step waits there for the doctor's
decision; when every rank accepted, the doctor commits it on all, else it cancels it on all.
No rank can so enter the check alone, however the requests and the steps interleave.

The step is chosen ahead of the furthest rank by the steps the job makes while the requests
travel: the step rate (each rank's last step read twice, 0.25 s apart) times a lead of a
second plus two round trips of the requests, as measured (to reach a node of a cluster job is
a scheduler call: hundreds of milliseconds). A cancelled step is chosen again with the rate
and round trip measured anew and the lead doubled, a bounded number of times.

A cluster job's ranks are asked on their nodes (diagnose.remote), every node at once in each
phase; the ranks answer with their RANK, and the report names each rank's node.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from areal_cli.diagnose import remote_call
from areal_cli.diagnose.targets import Job
from areal_cli.errors import ArealError, UsageError, WaitTimeout
from areal_cli.worker import channel

TRIES = 5
GAP_S = 0.25  # between the two reads of each rank's step


@dataclass
class DivergeResult:
    job: str
    step: int
    report: dict
    ranks: list[int]
    not_reached: list[int] = field(default_factory=list)
    seconds: float = 0.0
    tries: int = 1
    nodes: dict[int, str] = field(default_factory=dict)  # a cluster job: rank -> its node

    def to_json(self) -> dict:
        # "seconds" is the check's own time (in the report); wall_s the doctor's.
        out = {"job": self.job, "step": self.step, "ranks": self.ranks,
               "not_reached": self.not_reached, "wall_s": round(self.seconds, 3),
               "tries": self.tries, **self.report}  # fmt: skip
        if self.nodes:
            out["nodes"] = {str(r): n for r, n in sorted(self.nodes.items())}
            for m in out.get("mismatches") or []:
                m["nodes"] = sorted({self.nodes[r] for r in m["ranks"] if r in self.nodes})
        return out


class _Local:
    """The ranks of this host, asked over their channels directly."""

    def __init__(self, job: Job, deadline: float):
        self.pids = {r.rank if r.rank is not None else i: r.pid for i, r in enumerate(job.ranks)}
        self.nodes: dict[int, str] = {}
        self.world_size = job.world_size
        self.deadline = deadline

    def ask(self, op: str, timeout: float = 5.0, **args) -> dict[int, dict | Exception]:
        timeout = _within(timeout, self.deadline)

        def one(pid: int):
            try:
                return channel.ask(pid, op, timeout=timeout, **args)
            except channel.ChannelError as e:
                return e

        with ThreadPoolExecutor(max_workers=min(32, len(self.pids) or 1)) as ex:
            return dict(zip(self.pids, ex.map(one, self.pids.values()), strict=True))

    def progress_twice(self, gap: float) -> tuple[dict, dict]:
        first = self.ask("progress")
        if any(isinstance(a, Exception) for a in first.values()):
            return first, first  # a rank that did not answer once is named now
        time.sleep(gap)
        return first, self.ask("progress")

    def stopped(self, ranks) -> dict[int, int]:
        """rank -> pid of those of `ranks` whose process is stopped (SIGSTOP, a debugger)."""
        return {r: self.pids[r] for r in ranks if r in self.pids and _stopped(self.pids[r])}


class _Nodes:
    """The ranks of a cluster job, asked on their nodes: one scheduler call per phase."""

    def __init__(self, job: Job, deadline: float):
        self.deadline = deadline
        self.job = job
        self.nodes: dict[int, str] = {}
        self.pids: dict[int, int] = {}
        self.world_size = 0  # the largest WORLD_SIZE a node's ranks carry

    def _call(self, op: str, timeout: float, gap: float = 0.0, **args) -> list[dict]:
        argv = ["diverge", "--op", op]
        if "step" in args:
            argv += ["--step", str(args["step"])]
        if "wait" in args:
            argv += ["--wait", str(args["wait"])]
        if gap:
            argv += ["--gap", str(gap)]
        got = remote_call.on_nodes(self.job, argv, timeout=timeout + gap + 30.0)
        bad = {n: why for n, (data, why) in got.items() if data is None or data.get("error")}
        if bad:
            node, why = next(iter(bad.items()))
            raise ArealError(f"{self.job.label}: {why}")
        out = []
        for node, (data, _why) in got.items():
            for r in data.get("ranks", []):
                rank = r["rank"] if r["rank"] is not None else r["pid"]
                self.nodes[rank], self.pids[rank] = node, r["pid"]
                self.world_size = max(self.world_size, r.get("world_size") or 0)
            out.append(data)
        return out

    def _answers(self, data: list[dict], key: str = "answers") -> dict[int, dict | Exception]:
        out: dict[int, dict | Exception] = {}
        for d in data:
            rank_of = {r["pid"]: r["rank"] if r["rank"] is not None else r["pid"]
                       for r in d.get("ranks", [])}  # fmt: skip
            for pid, a in (d.get(key) or {}).items():
                rank = rank_of.get(int(pid), int(pid))
                if "channel_error" in a:
                    out[rank] = channel.ChannelError(
                        f"{a['channel_error']} (node {d.get('node')})", a.get("kind", "failed")
                    )
                else:
                    out[rank] = a
        return out

    def ask(self, op: str, timeout: float = 5.0, **args) -> dict[int, dict | Exception]:
        return self._answers(self._call(op, _within(timeout, self.deadline), **args))

    def progress_twice(self, gap: float) -> tuple[dict, dict]:
        data = self._call("progress", _within(5.0, self.deadline), gap=gap)
        return self._answers(data), self._answers(data, "again")

    def stopped(self, ranks) -> dict[int, int]:
        return {}  # another node's /proc is not ours to read


def _within(timeout: float, deadline: float) -> float:
    """A request's timeout that ends by the run's deadline (--timeout is for the whole run)."""
    return max(0.5, min(timeout, deadline - time.monotonic()))


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (state T) or stopped by a tracer (t): it answers
    nothing, its channel thread included, until it gets SIGCONT."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] in (b"T", b"t")
    except (OSError, ValueError):
        return False


def _raise_stopped(ranks, which, job: Job) -> None:
    stopped = ranks.stopped(which)
    if stopped:
        pids = " ".join(str(p) for p in stopped.values())
        raise UsageError(
            f"rank(s) {sorted(stopped)} of {job.label} (pid {pids}) are stopped (state T): a "
            "stopped process answers nothing and the others wait for it in their collectives",
            hint=f"kill -CONT {pids} resumes them; then run this again",
        )


def run(
    job: Job, *, timeout: float = 60.0, lead_s: float = 1.0, tries: int = TRIES
) -> DivergeResult:
    t0 = time.monotonic()
    deadline = t0 + timeout  # for everything: the asks, the arming, the wait for the step
    ranks = _Nodes(job, deadline) if job.on_other_nodes else _Local(job, deadline)
    first, again, rtt = _read_steps(job, ranks)
    target, armed, attempt = _arm(job, ranks, first, again, rtt, lead_s=lead_s, tries=tries)
    all_ranks = sorted(armed)
    results = _wait_results(ranks, target, all_ranks, deadline)
    missing = sorted(r for r in all_ranks if not results.get(r, {}).get("done"))
    done = [r for r in all_ranks if results.get(r, {}).get("done")]
    if not done:
        _raise_not_reached(job, ranks, target, all_ranks, timeout)
    report = results[done[0]]["report"]
    return DivergeResult(job.name or job.label, target, report, all_ranks, missing,
                         time.monotonic() - t0, attempt, dict(ranks.nodes))  # fmt: skip


def _read_steps(job: Job, ranks) -> tuple[dict, dict, float]:
    """Every rank's step read twice, GAP_S apart, and one request's round trip; UsageError
    when a rank does not answer, reports no step, or is not among those found."""
    sent = time.monotonic()
    first, again = ranks.progress_twice(GAP_S)
    # One request's round trip: what the two reads took beyond the gap between them, halved.
    rtt = max(0.0, (time.monotonic() - sent - GAP_S) / 2)
    _raise_unanswered(first, job, ranks)
    _raise_unanswered(again, job, ranks)
    steps = {r: a["step"] for r, a in again.items()}
    if any(s is None for s in steps.values()):
        silent = sorted(r for r, s in steps.items() if s is None)
        raise UsageError(
            f"rank(s) {silent} of {job.label} report no step",
            hint="the training loop must call ctx.progress(step) once per step",
        )
    world = max(ranks.world_size, len(steps))
    if len(steps) < world:
        lost = sorted(set(range(world)) - set(steps))
        raise UsageError(
            f"rank(s) {lost} of {job.label} (world size {world}) were not found: the check is a "
            "collective of every rank",
            hint="name the job (--job E/T) or its launcher's pid, not some of its ranks",
        )
    return first, again, rtt


def _arm(
    job: Job, ranks, first: dict, again: dict, rtt: float, *, lead_s: float, tries: int
) -> tuple[int, dict, int]:
    """Name a step ahead of every rank and commit it once all of them took it, a step further
    ahead each try: (the step, each rank's answer to the arm, the tries it took)."""
    rate = _rate(first, again)
    target = None
    for attempt in range(1, tries + 1):
        # The arm reaches the last rank within a round trip and the decision within another;
        # a rank that gets there first waits, so the lead only keeps that wait short.
        ahead = lead_s * 2 ** (attempt - 1) + 2 * rtt
        target = max(a["step"] for a in again.values()) + 1 + math.ceil(rate * ahead)
        sent = time.monotonic()
        try:
            armed = ranks.ask("diverge_arm", step=target)
        except ArealError:
            # A node that did not answer: the others may hold the step armed; take it back.
            _cancel_quietly(ranks, target)
            raise
        rtt = max(rtt, time.monotonic() - sent)
        if all(isinstance(a, dict) and a.get("armed") for a in armed.values()):
            _commit(job, ranks, target, armed)
            return target, armed, attempt
        ranks.ask("diverge_cancel", step=target)
        _raise_unanswered(armed, job, ranks)
        first, again = ranks.progress_twice(GAP_S)
        _raise_unanswered(again, job, ranks)
        rate = max(rate, _rate(first, again))
    now = {r: a.get("step") for r, a in again.items() if isinstance(a, dict)}
    raise ArealError(
        f"the ranks of {job.label} outran every step named to them ({tries} tries, the "
        f"last {target}; steps now {now}, about {rate:.0f} steps/s)",
        hint="try again; a job whose steps come in bursts is hardest to catch",
    )


def _commit(job: Job, ranks, target: int, armed: dict) -> None:
    """Every rank took the step: commit it, or say which ranks run the check without the
    others."""
    # A rank that watches no model could not take part in the check's collectives:
    # the check is not for this job (a bad target), not a mismatch.
    blind = sorted(r for r, a in armed.items() if not a.get("has_model", True))
    if blind:
        ranks.ask("diverge_cancel", step=target)
        raise UsageError(
            f"rank(s) {blind} of {job.label} watch no model: there is nothing to compare",
            hint="the training script names its model with areal_cli.worker.watch("
            "model, optimizer) (shard_model does it)",
        )
    try:
        committed = ranks.ask("diverge_commit", step=target)
    except ArealError as e:
        raise ArealError(
            f"{e.message}; the ranks of the nodes that took the commit of step "
            f"{target} run the check without the others'",
            hint="a job whose ranks then wait in the check hangs: areal doctor hang",
        ) from None
    lost = sorted(r for r, a in committed.items()
                  if not (isinstance(a, dict) and a.get("committed")))  # fmt: skip
    if lost:
        raise ArealError(
            f"rank(s) {lost} of {job.label} did not take the commit of step {target} "
            "(they gave up waiting for it); the others run the check without them",
            hint="a job whose ranks then wait in the check hangs: areal doctor hang",
        )


def _wait_results(ranks, target: int, all_ranks: list[int], deadline: float) -> dict[int, dict]:
    """rank -> its result of the check at `target` (done, or an error), until the deadline."""
    results: dict[int, dict] = {}
    while time.monotonic() < deadline and len(results) < len(all_ranks):
        # On a cluster job each poll is a scheduler call: wait longer in each.
        most = 10.0 if isinstance(ranks, _Nodes) else 2.0
        # Half a second short of the deadline: the answer then comes before the request's
        # own timeout (both end at the deadline otherwise, and a late answer is lost).
        wait = min(most, max(0.05, deadline - time.monotonic() - 0.5))
        got = ranks.ask("diverge_result", timeout=wait + 5, step=target, wait=wait)
        for r, a in got.items():
            if r in results:
                continue
            if isinstance(a, Exception):
                results[r] = {"done": False, "error": str(a)}
            elif a.get("done") or a.get("error"):
                results[r] = a
    return results


def _raise_not_reached(job: Job, ranks, target: int, all_ranks: list[int], timeout: float):
    """No rank finished the check in time: say where they are (stopped ones named)."""
    # Left armed on purpose: withdrawing it now could reach some ranks after the others
    # entered the check, and those would wait in its collectives for ever.
    stopped = ranks.stopped(all_ranks)
    if stopped:
        pids = " ".join(str(p) for p in stopped.values())
        raise WaitTimeout(
            f"no rank of {job.label} reached step {target} within {timeout:g}s: rank(s) "
            f"{sorted(stopped)} (pid {pids}) are stopped (state T); the check stays armed "
            "and runs if they get there",
            hint=f"kill -CONT {pids} resumes them",
        )
    now = ranks.ask("progress", timeout=1.0)
    where = {r: a["step"] for r, a in sorted(now.items()) if isinstance(a, dict)}
    raise WaitTimeout(
        f"no rank of {job.label} reached step {target} within {timeout:g}s (steps now "
        f"{where}); the check stays armed and runs if they get there",
        hint="a job that stopped stepping may hang: areal doctor hang",
    )


def _cancel_quietly(ranks, step: int) -> None:
    try:
        ranks.ask("diverge_cancel", step=step)
    except ArealError:
        pass


def _rate(first: dict, again: dict) -> float:
    """Steps per second of the furthest rank between the two reads."""
    a = [x["step"] for x in first.values() if isinstance(x, dict) and x.get("step") is not None]
    b = [x["step"] for x in again.values() if isinstance(x, dict) and x.get("step") is not None]
    if not a or not b:
        return 0.0
    return max(0, max(b) - max(a)) / GAP_S


def _raise_unanswered(answers: dict, job: Job, ranks=None) -> None:
    bad = {r: a for r, a in answers.items() if isinstance(a, Exception)}
    if not bad:
        return
    if ranks is not None:
        _raise_stopped(ranks, bad, job)
    first = next(iter(bad.values()))
    kinds = {getattr(a, "kind", "failed") for a in bad.values()}
    raise UsageError(
        f"rank(s) {sorted(bad)} of {job.label} do not answer the doctor's channel: {first}",
        hint="the ranks must run on areal's worker runtime (areal_cli.worker.connect())"
        if kinds == {"absent"}
        else "areal doctor hang shows where they are",
    )
