"""The watchdog on a training job: when no rank progressed for SECONDS, run the hang doctor on
every rank (and dump the servers the job uses), keep a bundle in the job's log folder and say
the verdict; once per stall.

Progress, per rank, best evidence first:

    reports    a rank on areal's worker runtime that called ctx.progress() (sync_weights and
               rollouts report too) answers `progress` over its doctor channel: its count moved
    movement   any other rank (a plain torchrun script, or one that never reported): its main
               thread ran (CPU time) or was woken at least WOKEN times since the last look, from
               /proc, as the hang doctor's own wake-up evidence; a thread blocked in a
               collective or a lock does neither

The job is stalled when no rank moved for its limit. A rank that spins in one loop looks alive
by movement; a reporting job catches it (its reports stop).

The limit, `--watchdog auto` (the default): a rank that reports steps also says the seconds
between its last ones (worker/channel.py); once MIN_STEPS of them are known, the limit is
FACTOR x the median step (of the slowest rank), held between FLOOR and the fixed SECONDS
(300 s), which is the limit before that and whenever no rank reports steps. `--watchdog
SECONDS` is that limit throughout.

Scheduler-independent: the local supervisor runs `Watchdog` in a thread of its own over the
ranks under its torchruns; a cluster scheduler calls `watch_nodes` with its job, its nodes and
its way to reach them (Scheduler.run_on_nodes): each look runs `python -m
areal_cli.diagnose.watchdog --marker M` on every node at once, which reads that node's ranks
(their doctor channels are Unix sockets, private to the node) and prints their looks; on a
stall the hang doctor samples every node the same way (diagnose.nodes).

A bundle is private (a 0700 folder of new 0600 files, never through a symlink: files): it
copies the last lines of logs only the job's user may read. Writing it may fail (a full disk):
the stall is still said, with why the bundle is missing, and acted on.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from areal_cli import files, logfiles
from areal_cli.diagnose import hang, nodes, stacks, targets
from areal_cli.errors import ArealError
from areal_cli.worker import channel

ACTIONS = ("observe", "fail")
# The verdict on a job whose ranks move while a server they use refuses every request: retries
# that never end look like work (request_errors).
REFUSED = "server-refuses-requests"
# Seconds between two looks at the servers' errors (a registry read each).
REFUSED_EVERY = 5.0
# On unless turned off: half the worker runtime's collective timeout (600 s), so the verdict is
# in the log before a timeout ends the job and takes the evidence with it; a healthy step (a
# long generation, a long weight sync) may take up to 0.8 x that, 240 s, without a verdict.
DEFAULT_SECONDS = 300.0
AUTO = "auto"
# `--watchdog auto`, from the GRPO example (tiny model, 2 CPU ranks, an hf server; the times
# between its ranks' step reports, 100 steps, benchmarks/bench_watchdog_auto.py): the slowest
# step was 2.5-2.8x the median of the 20 before it (the first weights written to disk and
# reloaded by the server, its checkpoints, a consistency check every 10 steps), 4.6x at a
# load average of 31; 4x the generated tokens made the median step 1.8-2.4x. FACTOR: a step
# 4x the others is no stall, with 2x to spare for a loaded host (steps drifted 3x over one
# run as the host's load rose). FLOOR: pauses the median cannot foresee in a job of short
# steps (a real model's checkpoint save, the page cache, a loaded host), plus the look (up to
# 2 s) and the doctor; 0.3 s steps still get a verdict within half a minute (21.2-21.4 s after
# the last step, measured). The median of the last STEP_TIMES (20, worker/channel.py) follows
# a drift within 10 steps; MIN_STEPS: one slow first step cannot make the median.
FACTOR = 10.0
FLOOR = 20.0
MIN_STEPS = 5  # step times known (of ctx.progress) before the median is trusted
WOKEN = 2  # wake-ups of a main thread between two looks that count as movement
LOG_NAME = "watchdog.log"
TAIL = 50  # lines of each rank's log kept in the bundle


@dataclass
class Stall:
    """What one stall produced."""

    at: float  # time.time() when the verdict was reached
    idle_s: float  # seconds since the last progress
    kind: str | None  # the verdict, None when the doctor could not read the ranks
    odd_ranks: list[int]
    summary: str
    bundle: str | None
    reached: dict[str, dict] = field(default_factory=dict)
    latency_s: float = 0.0  # from the last progress to the verdict
    bundle_error: str | None = None  # what of the bundle could not be written, and why
    limit_s: float | None = None  # the limit that applied (seconds without progress)
    limit: str = ""  # how it was chosen (`--watchdog auto`), "" when fixed

    def headline(self) -> str:
        odd = f" (odd ranks {','.join(map(str, self.odd_ranks))})" if self.odd_ranks else ""
        return f"{self.kind or 'no verdict'}{odd}: {self.summary}"

    def to_json(self) -> dict:
        return {
            "at": self.at,
            "idle_s": round(self.idle_s, 1),
            "latency_s": round(self.latency_s, 2),
            "kind": self.kind,
            "odd_ranks": self.odd_ranks,
            "summary": self.summary,
            "bundle": self.bundle,
            "bundle_error": self.bundle_error,
            "reached": self.reached,
            "limit_s": None if self.limit_s is None else round(self.limit_s, 2),
            "limit": self.limit,
        }


# --------------------------------------------------------------------------- evidence


def _main_thread(pid: int) -> tuple[int, int] | None:
    """(CPU ticks, context switches) of a process's main thread, or None when it is gone."""
    base = f"/proc/{pid}/task/{pid}"
    try:
        with open(f"{base}/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2 :].split()
        ticks = int(fields[11]) + int(fields[12])  # utime, stime
        switches = 0
        with open(f"{base}/status", "rb") as f:
            for line in f:
                if line.startswith((b"voluntary_ctxt_switches", b"nonvoluntary_ctxt_switches")):
                    switches += int(line.split()[1])
        return ticks, switches
    except (OSError, ValueError, IndexError):
        return None


def look(pid: int) -> tuple:
    """This rank's evidence now: ("reports", count, step intervals) or ("movement", ticks,
    switches), or ("gone",)."""
    path = channel.find(pid)
    if path is not None:
        try:
            got = channel.ask_path(path, "progress", timeout=2.0)
            count = int(got.get("count") or 0)
            if count > 0:
                return ("reports", count, [float(x) for x in got.get("intervals") or []])
        except (channel.ChannelError, ValueError, TypeError, AttributeError):
            pass
    got = _main_thread(pid)
    return ("gone",) if got is None else ("movement", *got)


def moved(before: tuple | None, now: tuple) -> bool:
    """Whether a rank made progress between two looks."""
    if before is None or now[0] != before[0]:
        return now[0] != "gone"  # first look, or it began to report: it runs
    if now[0] == "reports":
        return now[1] > before[1]
    if now[0] == "movement":
        return now[1] > before[1] or now[2] - before[2] >= WOKEN
    return False


@dataclass(frozen=True)
class Limit:
    """Seconds without progress that make a stall, and where they came from."""

    seconds: float
    auto: bool = False
    median_s: float | None = None  # the median step it was made from (auto, steps known)

    def why(self) -> str:
        """How it was chosen, for the verdict's line ("" when fixed by --watchdog SECONDS)."""
        if not self.auto:
            return ""
        if self.median_s is None:
            return f"auto: fixed until {MIN_STEPS} steps are timed"
        made = f"auto: {FACTOR:g}x the median step {_s(self.median_s)}"
        if self.seconds > FACTOR * self.median_s:
            return f"{made}, raised to the {_s(self.seconds)} floor"
        if self.seconds < FACTOR * self.median_s:
            return f"{made}, capped at {_s(self.seconds)}"
        return made


def _s(seconds: float) -> str:
    return f"{seconds:.2g}s" if seconds < 1 else f"{round(seconds, 1):g}s"


def step_median(looks: dict) -> float | None:
    """The median step of the slowest rank that timed at least MIN_STEPS steps, or None."""
    medians = []
    for lk in looks.values():
        if lk[0] == "reports" and len(lk) > 2:
            times = [t for t in lk[2] if 0 <= t < math.inf]  # NaN and inf say nothing
            if len(times) >= MIN_STEPS:
                medians.append(statistics.median(times))
    return max(medians) if medians else None


def auto_limit(median_s: float | None, seconds: float, floor: float = FLOOR) -> Limit:
    """`--watchdog auto`: FACTOR x the median step between `floor` and `seconds`, which is
    the limit until steps are timed."""
    if median_s is None:
        return Limit(seconds, auto=True)
    floor = min(floor, seconds)
    return Limit(min(max(FACTOR * median_s, floor), seconds), auto=True, median_s=median_s)


class StallClock:
    """No rank moved for `seconds`: fire once, then again only after progress resumed."""

    def __init__(self, seconds: float, now: float):
        self.seconds = seconds
        self.last_progress = now
        self.fired = False

    def update(self, any_moved: bool, now: float) -> bool:
        if any_moved:
            self.last_progress = now
            self.fired = False
            return False
        if not self.fired and now - self.last_progress >= self.seconds:
            self.fired = True
            return True
        return False


# --------------------------------------------------------------------------- the watchdog


RanksFn = Callable[[], "object | None"]  # -> a diagnose.targets.Job (ranks with pids), or None
# -> every rank's look now, keyed by what tells ranks apart (pid; (node, pid) on a cluster), or
# None while there is nothing to watch
LooksFn = Callable[[], "dict | None"]


class Watchdog:
    """Watch a job's ranks from a thread; on a stall, diagnose and call on_stall(Stall)."""

    def __init__(
        self,
        seconds: float,
        log_dir: str | Path,
        ranks: RanksFn,
        on_stall: Callable[[Stall], None],
        server_pids: Callable[[], list[int]] = list,
        tick: float | None = None,
        looks: LooksFn | None = None,
        keep_servers: Callable[[Path], None] | None = None,
        refused: Callable[[], list[str]] | None = None,
        auto: bool = False,
        floor: float = FLOOR,
    ):
        self.seconds = float(seconds)
        self.auto = auto
        self.floor = floor  # the lowest limit auto sets
        self.limit = Limit(self.seconds, auto=auto)  # the one in force now
        self._median: float | None = None  # the last step median known (auto)
        # -> one line per server the job uses that refuses its clients (request_errors)
        self.refused = refused
        self.log_dir = Path(log_dir)
        self.ranks = ranks
        self.server_pids = server_pids
        self.on_stall = on_stall
        self.tick = tick or min(1.0, max(0.2, self.lowest() / 10))
        self.stop = threading.Event()
        self.stalls: list[Stall] = []
        self._thread: threading.Thread | None = None
        self._looks = looks or self._local_looks
        self._job = None  # the local ranks, found again while they start or restart
        if keep_servers is not None:
            self._keep_servers = keep_servers

    def lowest(self) -> float:
        """The lowest limit this watchdog may apply."""
        return min(self.floor, self.seconds) if self.auto else self.seconds

    def _update_limit(self, looks: dict) -> Limit:
        if self.auto:
            # Kept while no rank says its step times (a channel that stopped answering):
            # a job that hangs keeps the limit its steps made.
            self._median = step_median(looks) or self._median
            self.limit = auto_limit(self._median, self.seconds, self.floor)
        return self.limit

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="areal-watchdog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def _local_looks(self) -> dict | None:
        job = self._job
        if (
            job is None
            or len(job.ranks) < len(job.expected_local_ranks())
            or any(_gone(r.pid) for r in job.ranks)
        ):
            job = self._job = self.ranks()  # ranks start one by one, and restart: find them
            if job is None or not job.ranks:
                return None
        return {r.pid: look(r.pid) for r in job.ranks}

    def _refusals(self) -> list[str]:
        try:
            return list(self.refused()) if self.refused is not None else []
        except Exception:  # a registry that does not answer now: no verdict from it
            return []

    def _check_refused(self, state: dict) -> None:
        """Ranks that move while a server refuses them everything: said once per episode."""
        now = time.monotonic()
        if self.refused is None or now < state.get("next", 0.0):
            return
        state["next"] = now + REFUSED_EVERY
        lines = self._refusals()
        if not lines:
            state["fired"] = False
            return
        if state.get("fired"):
            return
        state["fired"] = True
        summary = "; ".join(lines)
        bundle, error = self._write_bundle(self._job, None, summary)
        stall = Stall(at=time.time(), idle_s=0.0, kind=REFUSED, odd_ranks=[], summary=summary,
                      bundle=None if bundle is None else str(bundle), bundle_error=error)  # fmt: skip
        self.stalls.append(stall)
        try:
            self.on_stall(stall)
        except Exception:
            pass

    def _run(self) -> None:
        clock = StallClock(self.seconds, time.monotonic())
        seen: dict = {}
        refused: dict = {}
        while not self.stop.wait(self.tick):
            looks = self._looks()
            if not looks:
                clock.update(True, time.monotonic())  # nothing to watch is no stall
                continue
            self._check_refused(refused)
            clock.seconds = self._update_limit(looks).seconds
            any_moved = any(moved(seen.get(key), now) for key, now in looks.items())
            seen = looks
            now = time.monotonic()
            if clock.update(any_moved, now) and not self.stop.is_set():
                job = self.ranks() or self._job  # as they are now
                try:
                    stall = self._diagnose(job, now - clock.last_progress, clock.last_progress)
                except Exception as e:  # never the end of the watch: the stall still counts
                    stall = Stall(
                        at=time.time(), idle_s=now - clock.last_progress, kind=None,
                        odd_ranks=[], summary=f"the watchdog could not diagnose: {_why(e)}",
                        bundle=None, latency_s=time.monotonic() - clock.last_progress,
                    )  # fmt: skip
                stall.limit_s, stall.limit = self.limit.seconds, self.limit.why()
                self.stalls.append(stall)
                try:
                    self.on_stall(stall)
                except Exception:
                    pass
                # The doctor's py-spy attach woke the ranks: what they do from here on is
                # measured from now, so a job still hung is not called moving, nor stalled again.
                seen = self._looks() or {}

    def _diagnose(self, job, idle_s: float, last_progress: float) -> Stall:
        kind, odd, summary, reached, reports = None, [], "", {}, None
        try:
            reports = hang.diagnose([job], torch_analyzer=True)
            v = reports[0].analysis.verdict
            if v is not None:
                kind, odd, summary = v.kind, list(v.odd_ranks), v.summary
                reached = {str(r): e.to_json() for r, e in v.reached.items()}
        except Exception as e:  # an unreadable job still gets its logs kept and a line
            summary = f"the hang doctor could not read the ranks: {_why(e)}"
        refusals = self._refusals()
        if refusals:  # what the ranks wait for may be a server that refuses them
            summary = "; ".join([summary, *refusals]) if summary else "; ".join(refusals)
        bundle, error = self._write_bundle(job, reports, summary)
        return Stall(
            at=time.time(),
            idle_s=idle_s,
            kind=kind,
            odd_ranks=odd,
            summary=summary,
            bundle=None if bundle is None else str(bundle),
            reached=reached,
            latency_s=time.monotonic() - last_progress,
            bundle_error=error,
        )

    def _write_bundle(self, job, reports, summary: str) -> tuple[Path | None, str | None]:
        """The stall's bundle (the doctor's report, the servers' stacks, the logs' last lines)
        and what could not be written, each part tried on its own: a failed write (a full
        disk) is said, never raised."""
        # Loaded already where there are reports (it judged them); not at the top: `train`
        # imports this module for its limits.
        from areal_cli.diagnose import hang_judge

        try:
            bundle = new_bundle(self.log_dir)
        except Exception as e:
            return None, _why(e, self.log_dir)
        parts = [
            (lambda: hang_judge.write_bundle(reports, bundle)) if reports is not None
            else (lambda: files.write_private(bundle / "error.txt", summary + "\n")),
            lambda: self._keep_servers(bundle),
            lambda: self._keep_logs(job, bundle),
        ]  # fmt: skip
        errors = []
        for part in parts:
            try:
                part()
            except Exception as e:
                errors.append(_why(e, bundle))
        return bundle, "; ".join(dict.fromkeys(errors)) or None

    def _keep_servers(self, bundle: Path) -> None:
        pids = [p for p in self.server_pids() if not _gone(p)]
        if not pids:
            return
        out = files.private_dir(bundle / "servers")
        try:
            dumps = stacks.dump_many(pids, pyspy=stacks.require_pyspy())
        except Exception as e:
            files.write_private(out / "error.txt", f"{getattr(e, 'message', e)}\n")
            return
        for pid, d in dumps.items():
            if d.ok:
                files.write_private(out / f"server-pid{pid}.json", d.raw)
            else:
                files.write_private(
                    out / f"server-pid{pid}.error.txt", f"{d.error_kind}: {d.error}\n"
                )

    def _keep_logs(self, job, bundle: Path) -> None:
        out = files.private_dir(bundle / "logs")
        for label, path in logfiles.select_logs(self.log_dir).items():
            if label.startswith(("rank", "server", "torchrun")):
                lines = logfiles.tail(path, TAIL)
                files.write_private(out / f"{label}.tail.log", "\n".join(lines) + "\n")


def new_bundle(log_dir: str | Path) -> Path:
    """A new private folder `watchdog-<time>` in the job's log folder (one only the user can
    write): made by this call (mkdir never goes through what is at its name; a name taken
    gets a suffix), 0700 whatever the umask."""
    log_dir = Path(log_dir)
    files.check_dir(log_dir)
    base = f"watchdog-{time.strftime('%Y%m%d-%H%M%S')}"
    for n in range(100):
        path = log_dir / (base if n == 0 else f"{base}-{n}")
        try:
            os.mkdir(path, files.PRIVATE_DIR)
        except FileExistsError:
            continue
        files.check_dir(path)
        return path
    raise files.UnsafePath(f"no free name for a bundle in {log_dir} ({base}-N taken)")


def _why(e: BaseException, where: str | Path | None = None) -> str:
    """One line of why something failed: a full disk names its filesystem."""
    if where is not None and files.is_full(e):
        return files.disk_full(where, e).message
    if isinstance(e, ArealError):
        return e.message
    if isinstance(e, OSError):
        return f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
    return f"{type(e).__name__}: {e}"


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


def stall_limit(stall: Stall, seconds: float) -> str:
    """The limit a stall passed, as its line says it: "3s" (fixed), "20s (auto: 10x the
    median step 0.3s, raised to the 20s floor)"."""
    limit = seconds if stall.limit_s is None else stall.limit_s
    return f"{round(limit, 1):g}s" + (f" ({stall.limit})" if stall.limit else "")


def log_line(log_dir: str | Path, stall: Stall, seconds: float) -> str:
    """Append the verdict to the job's watchdog log (what `areal logs` shows); the line."""
    line = (
        f"{time.strftime('%H:%M:%S', time.localtime(stall.at))} stall: no rank progressed for "
        f"{stall_limit(stall, seconds)}; verdict {stall.headline()}; bundle {stall.bundle}"
        if stall.kind != REFUSED
        else f"{time.strftime('%H:%M:%S', time.localtime(stall.at))} refused: the ranks run, "
        f"but {stall.summary}; bundle {stall.bundle}"
    )
    for rank, e in sorted(stall.reached.items(), key=lambda kv: int(kv[0])):
        line += f"\n  rank {rank}: collective #{e['seq']} of group {e['desc'] or e['pg']} " \
                f"({e['op']}, {e['state']})"  # fmt: skip
    if stall.bundle_error:
        line += f"\n  bundle incomplete: {stall.bundle_error}"
    # What cannot be written (a full disk, a planted symlink) stops neither the line nor the
    # action on the stall: the caller shows the line and acts.
    try:
        fd = files.open_append(Path(log_dir) / LOG_NAME)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
    except (OSError, ArealError) as e:
        line += f"\n  not written to {LOG_NAME}: {_why(e, log_dir)}"
    if stall.bundle:
        try:
            verdict = json.dumps(stall.to_json(), indent=2) + "\n"
            files.write_private(Path(stall.bundle, "verdict.json"), verdict)
        except (OSError, ArealError):
            pass  # the verdict is in the line and in the job's record
    return line


# --------------------------------------------------------------------------- on a cluster

# reach(job_id, {node: argv}, timeout) -> {node: (stdout, why not)}: Scheduler.run_on_nodes
ReachFn = Callable[[str, dict, float], dict]


def cluster_tick(seconds: float, floor: float | None = None) -> float:
    """Seconds between looks on a cluster: each look starts a process on every node (an srun
    on Slurm, which costs the controller an RPC), so at most one a second. At most 4 s: the
    last progress is seen up to one look late and the stall up to one more, and with the
    doctor's few seconds the verdict must come within SECONDS + 10 s (auto: within its
    floor + 10 s, the lowest limit it may set)."""
    if floor is not None:
        seconds = min(floor, seconds)
    return min(4.0, max(1.0, seconds / 10))


def watch_nodes(
    seconds: float,
    log_dir: str | Path,
    *,
    job_id: str,
    nodes: Callable[[], list[str]],
    marker: str,
    reach: ReachFn,
    label: str,
    on_stall: Callable[[Stall], None],
    servers: Callable[[], dict[str, list[int]]] = dict,
    python: str | None = None,
    tick: float | None = None,
    refused: Callable[[], list[str]] | None = None,
    auto: bool = False,
    floor: float = FLOOR,
) -> Watchdog:
    """The watchdog on a job of a cluster scheduler, started: every tick, each node's ranks (the
    job's processes there carrying RANK, found by `marker`) are looked at where they run; on a
    stall the hang doctor samples every node through `reach`, and `servers` (node -> pids of the
    job's servers there) get their stacks kept in the bundle. `nodes` is asked at every look
    (a job's nodes are known once it runs)."""
    py = python or sys.executable
    limit = 15.0

    def looks() -> dict | None:
        names = nodes()
        if not names:
            return None
        argv = [py, "-m", "areal_cli.diagnose.watchdog", "--marker", marker]
        got = reach(job_id, {n: argv for n in names}, limit)
        out: dict = {}
        for node, (stdout, _why) in got.items():
            try:
                answer = json.loads((stdout or "").strip().splitlines()[-1])
            except (ValueError, IndexError):
                continue  # a node that did not answer shows no progress this time
            for pid, lk in (answer.get("looks") or {}).items():
                out[(node, int(pid))] = tuple(lk)
        return out or None

    def ranks():
        return targets.Job(
            label=label, ranks=[], name=label, scheduler_job_id=job_id,
            nodes={n: [] for n in nodes()}, marker=marker, reach=reach,
        )  # fmt: skip

    def keep_servers(bundle: Path) -> None:
        where = {n: p for n, p in servers().items() if p}
        if not where:
            return
        out = files.private_dir(bundle / "servers")
        cmds = {n: [py, "-m", "areal_cli.diagnose.watchdog", "--dump", ",".join(map(str, p))]
                for n, p in where.items()}  # fmt: skip
        for node, (stdout, why) in reach(job_id, cmds, 60.0).items():
            try:
                dumps = json.loads((stdout or "").strip().splitlines()[-1])["dumps"]
            except (ValueError, IndexError, KeyError, TypeError):
                files.write_private(out / f"{node}.error.txt", f"{why or 'no answer'}\n")
                continue
            for pid, d in dumps.items():
                if d.get("raw"):
                    files.write_private(out / f"server-{node}-pid{pid}.json", d["raw"])
                else:
                    text = f"{d.get('error')}\n"
                    files.write_private(out / f"server-{node}-pid{pid}.error.txt", text)

    dog = Watchdog(
        seconds, log_dir, ranks=ranks, on_stall=on_stall,
        tick=tick or cluster_tick(seconds, floor if auto else None), looks=looks,
        keep_servers=keep_servers, refused=refused, auto=auto, floor=floor,
    )  # fmt: skip
    dog.start()
    return dog


def _node_looks(marker: str) -> dict:
    """This node's side of a look: the job's ranks here and their looks."""
    ranks = nodes._ranks_here([], marker)
    return {"node": os.environ.get("AREAL_NODE_NAME"),
            "looks": {str(r["pid"]): list(look(r["pid"])) for r in ranks}}  # fmt: skip


def _node_dump(pids: list[int]) -> dict:
    try:
        dumps = stacks.dump_many(pids, pyspy=stacks.require_pyspy())
    except Exception as e:
        return {"dumps": {str(p): {"error": str(getattr(e, "message", e))} for p in pids}}
    return {"dumps": {str(p): {"raw": d.raw if d.ok else "", "error": d.error}
                      for p, d in dumps.items()}}  # fmt: skip


def node_main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m areal_cli.diagnose.watchdog")
    ap.add_argument("--marker")
    ap.add_argument("--dump", default="")
    a = ap.parse_args(argv)
    try:
        if a.dump:
            out = _node_dump([int(p) for p in a.dump.split(",") if p.strip()])
        else:
            out = _node_looks(a.marker or "")
    except Exception as e:  # reported to the watcher, which sees no progress from this node
        out = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(node_main())
