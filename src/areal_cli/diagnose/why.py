"""The root cause of a job that died: which failure came first, and which errors only
followed from it.

When one rank dies, its peers fail too: a collective times out, a socket is closed under
them, torchrun reports a ChildFailedError, AReaL's launcher a JobException. Those are
true but secondary; the user needs the first failure, its kind, and what to do next. Everything
here is pure: small rules over log lines (and kernel or job-record facts handed in), each
testable from recorded text, and logs read as they come from the field: prefixed by torch,
vLLM, Ray or SGLang, quoted, pasted without their indentation, cut short (why_lines).

    events = parse_log("rank-1", lines)          # what one log says, in its order
    report = analyze(events)                     # root cause first, the rest secondary
    report.advice                                # {action: restart|stop|unknown, reason}

The kinds, their evidence, tier and advice are one table (why_kinds.KINDS); the rules that
turn a single line into an event are another (why_parse.LINE_RULES).
"""

from __future__ import annotations

import re
import signal as _signal
import time as _time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from areal_cli import logfiles
from areal_cli.diagnose import logread, why_kinds
from areal_cli.diagnose.why_kinds import SECONDARY_KINDS, WEAK_KINDS, classify  # noqa: F401

# One log's events (why_parse), kept importable from here: callers know this module.
from areal_cli.diagnose.why_parse import (  # noqa: F401
    LINE_RULES,
    MEMORY_HINT,
    OOM_KINDS,
    Event,
    describe_code,
    line_time,
    parse_log,
    strip_prefix,
    user_frame,
)

HANG_HINT = (
    "nothing failed before this timeout: a hang. `areal doctor hang` (or the watchdog's "
    "bundle, areal train --watchdog) names the rank that never joined"
)


@dataclass
class Report:
    root: Event | None
    secondary: list[Event]
    sources: list[str] = field(default_factory=list)
    unsure: str | None = None  # why the root's rank cannot be named, where it cannot
    candidates: list[int] = field(default_factory=list)  # then: the ranks it may be

    @property
    def advice(self) -> dict | None:
        """What to do next, {action: restart | stop | unknown, reason}: the root cause's kind
        decides (a signal by who sent it); the restart work goes by it."""
        if self.root is None:
            return None
        return why_kinds.advice(self.root.kind, self.root.sender, self.root.exit_code)

    def to_json(self) -> dict:
        root = self.root.to_json() if self.root else None
        if root is not None:
            root["advice"] = self.advice
            if self.unsure:
                root.update(unsure=self.unsure, candidates=self.candidates)
        return {
            "root_cause": root,
            "advice": self.advice,
            "secondary": [e.to_json() for e in self.secondary],
            "sources": self.sources,
        }

    def headline(self) -> str | None:
        """One line for a failure report: 'python_exception: ValueError: ... at x.py:3'."""
        if self.root is None:
            return None
        at = f" at {self.root.where}" if self.root.where else ""
        by = f", sent by {self.root.sender}" if self.root.sender else ""
        return f"{self.root.kind}: {self.root.message}{at}{by}"


# -- the kernel's word on a SIGKILL -----------------------------------------------------------

_DMESG_KILL = re.compile(
    r"(?:Out of memory|Memory cgroup out of memory): Killed process (\d+) \(([^)]*)\)"
)
_DMESG_OOMKILL = re.compile(r"oom-kill:.*?task=([^,]+),pid=(\d+)")


def kernel_oom_kills(dmesg: str) -> dict[int, str]:
    """pid → the kernel's line, for every process the OOM killer killed (dmesg's text)."""
    out: dict[int, str] = {}
    for line in dmesg.splitlines():
        m = _DMESG_KILL.search(line)
        if m:
            out[int(m.group(1))] = line.strip()
            continue
        m = _DMESG_OOMKILL.search(line)
        if m:
            out.setdefault(int(m.group(2)), line.strip())
    return out


def cgroup_oom_kills(text: str) -> int | None:
    """The oom_kill count of a cgroup's memory.events (v2) or memory.oom_control (v1)."""
    m = re.search(r"^oom_kill (\d+)$", text, re.M)
    return int(m.group(1)) if m else None


@dataclass
class Kernel:
    """What the kernel says about memory kills: read on this host, or recorded."""

    oom_kills: dict[int, str] = field(default_factory=dict)
    dmesg_readable: bool = False
    cgroup_oom_kill: int | None = None
    cgroup_file: str | None = None
    host: str | None = None  # where it was read: a rank on another node is not in it


def read_kernel() -> Kernel:
    """dmesg where this user may read it, and this process's cgroup's OOM-kill count."""
    import socket
    import subprocess

    k = Kernel(host=socket.gethostname())
    try:
        res = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5)
        if res.returncode == 0:
            k.dmesg_readable = True
            k.oom_kills = kernel_oom_kills(res.stdout)
    except (OSError, subprocess.SubprocessError):
        pass
    for path in _cgroup_memory_files():
        try:
            count = cgroup_oom_kills(Path(path).read_text())
        except OSError:
            continue
        if count is not None:
            k.cgroup_oom_kill, k.cgroup_file = count, path
            break
    return k


def _cgroup_memory_files() -> list[str]:
    out = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            out.append(f"/sys/fs/cgroup{path.rstrip('/')}/memory.events")
        elif "memory" in controllers.split(","):
            out.append(f"/sys/fs/cgroup/memory{path.rstrip('/')}/memory.oom_control")
    return out


# -- the job's records -----------------------------------------------------------------------


def record_events(
    state: str | None,
    message: str | None,
    servers: Sequence[tuple] = (),
    time: float | None = None,
    killed_by: str | None = None,
) -> list[Event]:
    """What a job record says: who stopped the job (areal stop, Ctrl-C, Slurm), and which
    server exited. `servers`: (label, exit code[, address]). `killed_by`: who ends a job that
    its record calls killed, as the job's scheduler declares (its `killed_by`): the caller
    holds the scheduler, so the doctor imports none."""
    out: list[Event] = []
    msg = (message or "").strip()
    low = msg.lower()
    sender = None
    slurm = re.match(r"slurm: (\w+)", low)  # how Slurm said a job ended (its state)
    if slurm and slurm.group(1) == "out_of_memory":
        out.append(Event("oom_killer", msg, "job record", time=time, hint=MEMORY_HINT,
                         sender="the kernel's OOM killer (Slurm: OUT_OF_MEMORY)",
                         order=(-1, 0)))  # fmt: skip
    elif slurm and slurm.group(1) in _SLURM_ENDS:
        sender = _SLURM_ENDS[slurm.group(1)]
    elif state == "killed" and killed_by:
        sender = killed_by
    elif low.startswith("watchdog:"):
        # --watchdog-action fail ended a job that stopped progressing: that stall is the
        # cause, the teardown's signals follow from it.
        out.append(Event("hang", msg.split(":", 1)[1].strip(), "job record", time=time,
                         sender="the watchdog (--watchdog-action fail)", order=(-1, 0),
                         hint="the watchdog's bundle (verdict, stacks) is in the job's log "
                         "folder; `areal logs E/T --role watchdog` shows its verdict"))  # fmt: skip
    elif "areal stop" in low:
        sender = "areal stop"
    elif state == "cancelled":
        sender = "Slurm cancel (scancel)"
    elif "time limit" in low:
        sender = "Slurm time limit"
    elif "preempt" in low:
        sender = "Slurm preemption"
    elif low == "interrupted":
        sender = "Ctrl-C (SIGINT)"
    elif low == "terminated":
        sender = "SIGTERM to areal"
    if sender is not None and state in ("stopped", "cancelled", "killed", "failed"):
        out.append(Event("signal", msg or state or "stopped", "job record", time=time,
                         sender=sender, order=(-1, 0)))  # fmt: skip
    for label, code, *addr in servers:
        if code not in (None, 0, -15, 143):
            at = f" at {addr[0]}" if addr and addr[0] else ""
            out.append(Event("server_died", f"{label}{at} exited ({describe_code(code)})",
                             label, exit_code=code, order=(-1, 1)))  # fmt: skip
    return out


_SLURM_ENDS = {
    "timeout": "Slurm time limit",
    "preempted": "Slurm preemption",
    "node_fail": "Slurm node failure",
    "deadline": "Slurm deadline",
    "boot_fail": "Slurm (the node failed to boot)",
}


# -- the verdict ------------------------------------------------------------------------------

# Who stops a whole job from outside outranks what its ranks say while they are stopped.
_EXTERNAL = ("areal stop", "Slurm", "Ctrl-C", "SIGTERM to areal", "the watchdog")


def analyze(events: Sequence[Event], kernel: Kernel | None = None) -> Report:
    """The first failure and the rest, each secondary saying what caused it.

    Ordering: a stop from outside (the record, Slurm's cancel line) first; else the failures
    that are not consequences (exceptions, OOMs, mismatches, a signal that killed a rank),
    earliest first where every one of them has a time, else the rank torchrun names as its
    first observed failure, else the order the logs give. Timeouts, closed connections,
    torchrun's ChildFailedError and the launcher's JobException are root only when
    nothing else is there."""
    events = list(events)
    events += _from_torchrun_report(events, kernel)
    for e in events:
        if e.source.startswith("server-") and e.kind in ("python_exception", "native_abort"):
            e.kind = "server_error"
    if not events:
        return Report(None, [])
    external = [e for e in events if e.kind in ("signal", "hang") and e.sender
                and e.sender.startswith(_EXTERNAL)]  # fmt: skip
    primary = [e for e in events if not e.secondary_kind and e.kind not in WEAK_KINDS
               and e not in external and not e.cut]  # fmt: skip
    # A launcher's word that a process ended (a signal, an exit code, a dead worker), and a
    # traceback the log ends inside (a process killed while it printed it): root only when
    # no rank says more.
    weak = [e for e in events if (e.kind in WEAK_KINDS or e.cut) and e not in external]
    named = next((e.names_rank for e in events if e.names_rank is not None), None)

    if external:
        root = min(external, key=lambda e: (e.time or float("inf"), e.order))
    elif primary:
        if all(e.time is not None for e in primary):
            # At one time, the rank torchrun names as the first observed failure.
            root = min(primary, key=lambda e: (e.time, _not_named(e, named), e.order))
        else:
            root = min(primary, key=lambda e: (e.kind != "server_died", _not_named(e, named),
                                               e.order))  # fmt: skip
    elif weak:
        # A launcher told to stop (a signal to a node's torchrun: no rank, no exit code, no
        # time) is how one node's failure ends the others (srun --kill-on-bad-exit, the
        # teardown): it does not hide the times of the ranks' own ends.
        timed = [e for e in weak if e.time is not None]
        stopped = [e for e in weak if e.kind == "signal" and e.rank is None
                   and e.exit_code is None and e.time is None]  # fmt: skip
        if timed and len(timed) + len(stopped) == len(weak):
            # Several nodes' reports: the earliest failure, whichever report names it.
            root = min(timed, key=lambda e: (e.cut, e.time, _not_named(e, named), e.order))
        else:
            root = min(weak, key=lambda e: (e.cut, _not_named(e, named),
                                            e.time or float("inf"), e.order))  # fmt: skip
    else:
        # Only consequences: the one that is itself the failure (a hang that timed out),
        # torchrun's summary last.
        rank_of = {"server_error": 0, "collective_timeout": 1, "connection_lost": 2}
        root = min(events, key=lambda e: (rank_of.get(e.kind, 3), e.time or float("inf"),
                                          e.order))  # fmt: skip
    unsure, candidates = _unsure(root, events, named)
    if unsure:
        root.rank = None  # name no rank rather than a wrong one: the candidates say which
    if root.rank is not None and root.node is None:
        root.node = _node_of(root.rank, events)
    same = [e for e in events if e is not root and _same(e, root)]
    root.ranks = sorted({e.rank for e in [root, *same] if e.rank is not None})
    if root.kind in OOM_KINDS:
        root.hint = MEMORY_HINT
    elif root.kind == "collective_timeout":
        root.hint = HANG_HINT
    cause = root.short()
    secondary = []
    seen: set = set()
    for e in sorted((e for e in events if e is not root), key=lambda e: e.order):
        dedup = (e.rank, e.source, e.kind, e.message)
        if dedup in seen:
            continue
        seen.add(dedup)
        e.caused_by = "the same failure as the root cause" if _same(e, root) else cause
        secondary.append(e)
    return Report(root, secondary, unsure=unsure, candidates=candidates)


def _unsure(root: Event, events: Sequence[Event], named: int | None) -> tuple[str | None, list]:
    """Where the verdict cannot name the rank that failed first: (why, the candidate ranks).
    Only consequences (every rank timed out), or launchers' reports that neither time nor
    name the first failure (srun's tasks)."""
    if root.kind not in SECONDARY_KINDS and root.kind not in WEAK_KINDS:
        return None, []
    alike = [e for e in events if e.kind == root.kind]
    ranks = sorted({e.rank for e in alike if e.rank is not None})
    if root.kind in SECONDARY_KINDS:
        if len(ranks) > 1:
            return ("only consequences are in these logs, on each of these ranks: they do not "
                    "name the rank that failed first", ranks)  # fmt: skip
        return None, []
    timed = all(e.time is not None for e in alike) and len({e.time for e in alike}) > 1
    if len(ranks) > 1 and not timed and (named is None or root.rank != named):
        return ("launchers report these ranks ended, without saying which was first", ranks)
    return None, []


def _not_named(e: Event, named: int | None) -> bool:
    """Whether `e` is not the rank a launcher's report names (none named: no preference)."""
    return named is not None and e.rank != named


def _node_of(rank: int, events: Sequence[Event]) -> str | None:
    """The node whose torchrun (its log torchrun-<node>.log) reported the rank's failure."""
    for e in events:
        if e.source.startswith("torchrun-") and any(f["rank"] == rank for f in e.failures):
            return e.source.removeprefix("torchrun-")
    return None


def _same(a: Event, b: Event) -> bool:
    return a.kind == b.kind and a.message == b.message and a.where == b.where


def _from_torchrun_report(events: list[Event], kernel: Kernel | None) -> list[Event]:
    """A rank that a signal killed writes nothing: a launcher's report says so (torchrun's
    failures block or its one line, deepspeed's, srun's, a CalledProcessError). One event per
    such rank with no failure of its own in its log: a signal, or the exit code when the
    rank's own error is not in these logs; SIGTERM is torchrun stopping the peers of the
    first failure."""
    out: list[Event] = []
    own = {e.rank for e in events if not e.secondary_kind and e.rank is not None}
    slurm_oom = [e for e in events if e.kind == "oom_killer" and e.rank is None]
    # torchrun's one-line report names a node's local rank; its failures block, the global
    # rank of the same pid (rank 1 is local_rank 0 on the second node of two).
    global_rank = {f["pid"]: f["rank"] for e in events for f in e.failures
                   if not f.get("local") and f["pid"] and f["rank"] is not None}  # fmt: skip
    # srun's task numbers count what it started: with a torchrun per node (whose reports
    # name the ranks) task 0 is the first node's torchrun, not rank 0, and its end in the
    # step's teardown is not a rank's.
    per_node = any(not f.get("srun") for e in events for f in e.failures)
    seen: set = set()
    for e in events:
        for f in e.failures:
            code, rank = f["exit_code"], f["rank"]
            if f.get("srun") and per_node:
                continue
            if f.get("local"):
                rank = global_rank.get(f["pid"], rank)
            if code in (None, 0) or (rank is not None and rank in own):
                continue
            if rank is None and (code, f["pid"]) in seen:
                continue
            seen.add((code, f["pid"]))
            sig = -code if code < 0 else (code - 128 if code > 128 else 0)
            if sig == _signal.SIGTERM:
                continue  # torchrun's own teardown of the survivors
            who = f"rank {rank}" if rank is not None else "a rank"
            pid = f" (pid {f['pid']})" if f["pid"] else ""
            if sig:
                ev = Event("signal", f"{who} {describe_code(code)}{pid}", e.source, rank,
                           line=e.line, time=f["time"], pid=f["pid"], exit_code=code,
                           order=e.order, path=e.path)  # fmt: skip
                if sig == _signal.SIGKILL:
                    _kernel_verdict(ev, kernel, slurm_oom, host=f.get("host"))
                elif sig == _signal.SIGABRT:
                    ev.kind = "native_abort"
            else:
                ev = Event("exit_code", f"{who} exited with exit code {code}{pid}; its own "
                           "error is not in these logs", e.source, rank, line=e.line,
                           time=f["time"], pid=f["pid"], exit_code=code, order=e.order,
                           path=e.path)  # fmt: skip
            if rank is not None:
                own.add(rank)
            out.append(ev)
    return out


def _kernel_verdict(
    ev: Event, kernel: Kernel | None, slurm_oom: Sequence[Event] = (), host: str | None = None
) -> None:
    """A SIGKILL is the OOM killer's when the kernel's log names that pid, or when Slurm saw
    an OOM kill in the step (on a node whose kernel log is not here); otherwise it came
    from someone (the cgroup's count says whether the OOM killer acted at all). `host`: where
    the launcher says the rank ran; another host's kernel log is not this one's."""
    if slurm_oom:
        ev.kind = "oom_killer"
        ev.message = f"rank {ev.rank} (pid {ev.pid}) killed by the OOM killer in its Slurm step"
        ev.detail = [slurm_oom[0].message]
        ev.sender = "the kernel's OOM killer (Slurm counted it)"
        ev.hint = MEMORY_HINT
        return
    if kernel is None:
        ev.sender = "unknown (no kernel record read)"
        return
    if host and kernel.host and host.split(".")[0] != kernel.host.split(".")[0]:
        # A pid of another machine says nothing about this one's kernel log.
        ev.sender = (f"unknown: the OOM killer or someone outside the job on {host}, whose "
                     "kernel log (dmesg) is not read here")  # fmt: skip
        return
    line = kernel.oom_kills.get(ev.pid) if ev.pid else None
    if line:
        ev.kind = "oom_killer"
        ev.message = f"rank {ev.rank} (pid {ev.pid}) killed by the kernel's OOM killer"
        ev.detail = [line]
        ev.sender = "the kernel's OOM killer"
        ev.hint = MEMORY_HINT
        return
    notes = []
    here = f" on {kernel.host}" if kernel.host else ""
    if kernel.dmesg_readable:
        notes.append(f"dmesg{here} names no OOM kill of it")
    else:
        notes.append(f"dmesg{here} not readable")
    if kernel.cgroup_oom_kill:
        notes.append(
            f"the cgroup counts {kernel.cgroup_oom_kill} OOM kill(s) ({kernel.cgroup_file})"
        )
        ev.hint = MEMORY_HINT
    ev.sender = "someone outside the job: " + "; ".join(notes)


# -- a job's folder -----------------------------------------------------------------------------


def label_rank(label: str) -> int | None:
    m = re.match(r"^rank-(\d+)$", label)
    return int(m.group(1)) if m else None


def parse_files(paths: Sequence[tuple[str, Path]]) -> list[Event]:
    """Events of several logs (label, path): each log's order kept, logs in the given order.
    Each log is read whole, in bounded memory (diagnose.logread)."""
    events: list[Event] = []
    for k, (label, path) in enumerate(paths):
        try:
            year = _time.localtime(Path(path).stat().st_mtime).tm_year
            if logread.not_a_log(path):
                continue  # a FIFO would block, a device never end
            found = logread.parse_whole(
                path, partial(parse_log, label, rank=label_rank(label), year=year)
            )
        except OSError:
            continue
        for n, e in enumerate(found):
            e.order = (k, e.line or 0, n)
            e.path = str(path)
            events.append(e)
    return events


def diagnose_dir(
    log_dir: str | Path,
    *,
    kind: str | None = None,
    extra: Sequence[tuple[str, Path]] = (),
    records: Sequence[Event] = (),
    kernel: Kernel | None = None,
) -> Report:
    """A job's log folder (every server, rank, torchrun and supervisor log, on every node
    of a shared folder), plus what its record says. `kind` (serve, train, serve+train): only
    that job's own logs, where a trial's serving and training jobs share the folder."""
    logs = [*logfiles.select_logs(Path(log_dir)).items(), *extra]
    if kind is not None:
        logs = [(label, p) for label, p in logs if _belongs(label, kind)]
    for e in records:
        e.path = e.path or next((str(p) for label, p in logs if label == e.source), None)
    rep = analyze([*records, *parse_files(logs)], kernel)
    rep.sources = [str(p) for _, p in logs]
    return rep


def _belongs(label: str, kind: str) -> bool:
    serves, trains = "serve" in kind, "train" in kind
    if label.startswith("server-"):
        return serves
    if label.startswith(("rank-", "torchrun", "watchdog")):
        return trains
    if label.startswith("supervisor-"):
        # supervisor-serve.log / supervisor-train.log (Slurm's batch output per job)
        return label.removeprefix("supervisor-") in kind.split("+")
    return True


def first_failure(
    log_dir: str | Path, torchrun_logs: Sequence[str | Path] = (), kernel: Kernel | None = None
) -> tuple[int | None, int | None, Report]:
    """(rank, its exit code, the report) of a training job that just failed: what the
    failure report of `areal train` names. `torchrun_logs` outside the folder count too."""
    known = {str(p) for p in logfiles.select_logs(Path(log_dir)).values()}
    extra = [(Path(p).stem, Path(p)) for p in torchrun_logs if str(p) not in known]
    rep = diagnose_dir(log_dir, kind="train", extra=extra, kernel=kernel)
    root = rep.root
    if root is None or root.rank is None:
        return None, None, rep
    code = root.exit_code
    for e in [root, *rep.secondary]:
        for f in e.failures:
            if f["rank"] == root.rank and f["exit_code"] is not None:
                code = f["exit_code"]
    return root.rank, code, rep
