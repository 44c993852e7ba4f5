"""The root cause of a job that died: which failure came first, and which errors only
followed from it.

When one rank dies, its peers fail too: a collective times out, a socket is closed under
them, torchrun reports a ChildFailedError, AReaL's launcher a JobException. Those are
true but secondary; the user needs the first failure and its kind. Everything here is
pure: small rules over log lines (and kernel or job-record facts handed in), each
testable from recorded text.

    events = parse_log("rank-1", lines)          # what one log says, in its order
    report = analyze(events)                     # root cause first, the rest secondary

Kinds: python_exception, cpu_oom, cuda_oom, oom_killer, collective_mismatch,
collective_timeout, connection_lost, signal, server_died, native_abort, hang (the
watchdog ended a job that stopped progressing), and the purely
secondary child_failed (torchrun), launcher_failed (AReaL's JobException),
teardown_warning (ProcessGroupNCCL at exit) and server_error (a server's traceback).
"""

from __future__ import annotations

import re
import signal as _signal
import time as _time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# A failure of one of these kinds is what peers suffer after the first rank died: never
# the root cause while anything of another kind is there.
SECONDARY_KINDS = (
    "collective_timeout",
    "connection_lost",
    "child_failed",
    "launcher_failed",
    "teardown_warning",
    "stopped_by_launcher",
    # A traceback a server logged: it may have answered one request badly and lived on; a
    # server that died is the record's server_died.
    "server_error",
)
OOM_KINDS = ("cpu_oom", "cuda_oom", "oom_killer")
MEMORY_HINT = "next: `areal doctor memory` shows what held the memory"
HANG_HINT = (
    "nothing failed before this timeout: a hang. `areal doctor hang` (or the watchdog's "
    "bundle, areal train --watchdog) names the rank that never joined"
)

_PREFIX = re.compile(r"^\[(?:default|rank)(\d+)\]:\s?")
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (.+)$')
_CHAIN = ("During handling of the above exception", "The above exception was the direct cause")
_TERMINATE = re.compile(r"terminate called after throwing an instance of '([^']+)'")
_WHAT = re.compile(r"^\s*what\(\):\s*(.*)$")
_SLURM_CANCEL = re.compile(
    r"\*\*\* (JOB|STEP) ([\w.+]+) ON (\S+) CANCELLED AT (\S+)(?: DUE TO ([A-Z ]+?))?(?: \*\*\*|$)"
)
_NCCL_WATCHDOG = re.compile(r"Watchdog caught collective operation timeout: (.*)")
_TEARDOWN = re.compile(
    r"destroy_process_group\(\) was not called|process group has NOT been destroyed"
)
_OUR_STOP = re.compile(r"^stopping: (SIG\w+)$")  # our torchrun runner, when it is stopped
# slurmstepd, when the step's cgroup saw the kernel's OOM killer (21.08+ and older wording).
_SLURM_OOM = re.compile(r"Detected (\d+) oom[-_]kill event")
# Timestamps as the logs write them: glog (torch's C++ and torchrun), AReaL, Python logging.
_GLOG = re.compile(r"^\[?[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)(\.\d+)?\s")
_AREAL_TS = re.compile(r"^(\d{4})(\d\d)(\d\d)-(\d\d):(\d\d):(\d\d)(\.\d+)?\s")
_PY_TS = re.compile(r"^(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:[,.](\d+))?")
_TORCHRUN_TIME = re.compile(r"^\s*time\s*:\s*(\d{4})-(\d\d)-(\d\d)_(\d\d):(\d\d):(\d\d)")
_FAILURE_FIELD = re.compile(r"^\s*(rank|exitcode|host|time|traceback)\s*:\s*(.*)$")


@dataclass
class Event:
    """One failure a log shows (or a job record, or the kernel)."""

    kind: str
    message: str
    source: str  # the log's label (rank-1, torchrun, server-0, a file name) or "job record"
    rank: int | None = None
    where: str | None = None  # file:line of the user's frame that raised
    line: int | None = None  # 1-based line in its source
    time: float | None = None  # epoch seconds, where the log says when
    pid: int | None = None
    exit_code: int | None = None
    sender: str | None = None  # who sent a signal: areal stop, Slurm cancel, time limit, ...
    names_rank: int | None = None  # the rank torchrun's report names as its root cause
    detail: list[str] = field(default_factory=list)  # the traceback or the lines around it
    caused_by: str | None = None  # for a secondary: the root cause, in words
    hint: str | None = None
    ranks: list[int] = field(default_factory=list)  # every rank where the same failure shows
    failures: list[dict] = field(default_factory=list)  # torchrun's report: rank, exit code
    path: str | None = None  # the log file it is in
    node: str | None = None  # where the rank ran, where a node's torchrun log says
    order: tuple = ()  # where it sits in the logs' own order

    @property
    def secondary_kind(self) -> bool:
        return self.kind in SECONDARY_KINDS

    def short(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else self.source
        at = f" at {self.where}" if self.where else ""
        return f"{who}: {self.kind}: {self.message}{at}"

    def to_json(self) -> dict:
        out = {
            "rank": self.rank,
            "source": self.source,
            "kind": self.kind,
            "message": self.message,
            "where": self.where,
        }
        extra = {
            "line": self.line,
            "path": self.path,
            "time": self.time,
            "exit_code": self.exit_code,
            "sender": self.sender,
            "node": self.node,
            "ranks": self.ranks or None,
            "caused_by": self.caused_by,
            "hint": self.hint,
        }
        out.update({k: v for k, v in extra.items() if v is not None})
        return out


@dataclass
class Report:
    root: Event | None
    secondary: list[Event]
    sources: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "root_cause": self.root.to_json() if self.root else None,
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


# -- one log ---------------------------------------------------------------------------------


def strip_prefix(line: str) -> tuple[int | None, str]:
    """(rank, text) of a line torchrun prefixed ("[default1]:[rank1]: ..."), the innermost
    prefix winning (torch's own `[rankN]:` is the global rank)."""
    rank = None
    while True:
        m = _PREFIX.match(line)
        if m is None:
            return rank, line
        rank, line = int(m.group(1)), line[m.end() :]


def line_time(text: str, year: int | None = None) -> float | None:
    """Epoch seconds of a line that starts with a timestamp (local time, as logs write it)."""
    for rx, has_year in ((_AREAL_TS, True), (_PY_TS, True), (_GLOG, False)):
        m = rx.match(text)
        if m is None:
            continue
        g = m.groups()
        if has_year:
            y, mo, d, hh, mm, ss = (int(x) for x in g[:6])
            frac = float("0." + g[6].lstrip(".")) if g[6] else 0.0
        else:
            y = year or _time.localtime().tm_year
            mo, d, hh, mm, ss = (int(x) for x in g[:5])
            frac = float(g[5]) if g[5] else 0.0
        try:
            return _time.mktime((y, mo, d, hh, mm, ss, 0, 0, -1)) + frac
        except (OverflowError, ValueError):
            return None
    return None


def classify(messages: Sequence[str], frames: Sequence[tuple[str, int, str]] = ()) -> str:
    """The kind of an exception from its message(s) (a chain: every link counts)."""
    text = "\n".join(messages)
    low = text.lower()
    if "cuda out of memory" in low or "outofmemoryerror" in low and "cuda" in low:
        return "cuda_oom"
    if re.search(r"\bMemoryError\b", text) or "can't allocate memory" in low:
        return "cpu_oom"
    if "received data size doesn't match" in low or "detected mismatch between collectives" in low:
        return "collective_mismatch"
    if "collective mismatch" in low or "collective_fingerprint" in low:
        return "collective_mismatch"
    if "childfailederror" in low:
        return "child_failed"
    if re.search(r"\bJobException\b", text):
        return "launcher_failed"
    if "signalexception" in low or re.search(r"got signal: \d+|\bkeyboardinterrupt\b", low):
        return "signal"
    if re.search(r"timed out|timeout|watchdog caught", low) and _collective(low, frames):
        return "collective_timeout"
    if re.search(
        r"connection (closed|reset)|broken pipe|remote process exited|ncclremoteerror|"
        r"connection refused|socket closed|peer closed|end of file|remotedisconnected",
        low,
    ):
        return "connection_lost"
    if re.search(r"timed out|timeout", low) and "distributed" in low:
        return "collective_timeout"
    return "python_exception"


def _collective(low: str, frames) -> bool:
    return (
        any("distributed" in f[0] or "c10d" in f[0] for f in frames)
        or "gloo" in low
        or "nccl" in low
        or "distbackenderror" in low
        or "diststoreerror" in low
        or "worknccl" in low
    )


def user_frame(frames: Sequence[tuple[str, int, str]]) -> tuple[str, int, str] | None:
    """The innermost frame of the user's code: not the standard library, not an installed
    package (site-packages), not torch itself."""
    for f in reversed(frames):
        path = f[0]
        if "/areal_cli/templates/" in path:
            return f  # our example scripts are the user's code (verdict.TEMPLATES)
        if path.startswith("<") or "site-packages/" in path or "dist-packages/" in path:
            continue
        if re.search(r"/lib/python3\.\d+/", path) or "/torch/" in path:
            continue
        return f
    return frames[-1] if frames else None


def parse_log(
    source: str, lines: Iterable[str], rank: int | None = None, year: int | None = None
) -> list[Event]:
    """The failures one log shows, in its order. `rank`: the log's own rank (rank-N.log);
    lines torchrun prefixed with a rank count for that rank (a combined torchrun log)."""
    lines = list(lines)
    year = _year_in(lines) or year
    streams: dict[int | None, list[tuple[int, str]]] = {}
    for n, raw in enumerate(lines, 1):
        r, text = strip_prefix(raw.rstrip("\n"))
        streams.setdefault(r if r is not None else rank, []).append((n, text))
    events: list[Event] = []
    for r, stream in streams.items():
        events += _parse_stream(source, r, stream, year)
    events.sort(key=lambda e: e.line or 0)
    for i, e in enumerate(events):
        e.order = (e.line or 0, i)
    return events


def _year_in(lines: list[str]) -> int | None:
    """The year of the log's last dated line: glog's timestamps have none."""
    for raw in reversed(lines[-2000:]):
        _, text = strip_prefix(raw)
        m = _AREAL_TS.match(text) or _PY_TS.match(text) or _TORCHRUN_TIME.match(text)
        if m:
            return int(m.group(1))
    return None


def _parse_stream(source: str, rank: int | None, stream, year) -> list[Event]:
    out: list[Event] = []
    last_time: tuple[int, float] | None = None  # (index, time) of the last timestamped line
    i, n = 0, len(stream)
    while i < n:
        lineno, text = stream[i]
        t = line_time(text, year)
        if t is not None:
            last_time = (i, t)
        if text.startswith("Traceback (most recent call last):"):
            ev, i = _traceback(source, rank, stream, i)
            if ev is not None:
                # The last timestamped line just before a traceback dates it (a lower bound,
                # so only when it is close).
                if ev.time is None and last_time and i - last_time[0] < 40:
                    ev.time = last_time[1]
                out.append(ev)
            continue
        if text.startswith(_CHILD_FAILED):
            # torchrun's report without its traceback (a log that starts or was cut there).
            ev = Event("child_failed", text.strip(), source, rank, line=lineno, time=t)
            block, i = _child_block(stream, i + 1)
            _child_failed(ev, block)
            out.append(ev)
            continue
        ev = _single_line(source, rank, stream, i, t)
        if ev is not None:
            out.append(ev)
        i += 1
    return out


_CHILD_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"


def _child_block(stream, i) -> tuple[list[str], int]:
    """torchrun's failures block from stream[i] to its closing rule."""
    block: list[str] = []
    while i < len(stream) and not stream[i][1].startswith("Traceback"):
        block.append(stream[i][1])
        i += 1
        if block[-1].startswith("=") and len(block) > 2:
            break
    return block, i


def _traceback(source, rank, stream, i) -> tuple[Event | None, int]:
    """A Python traceback (with its chained ones) from stream[i]: one event, and where the
    scan goes on."""
    frames: list[tuple[str, int, str]] = []
    messages: list[str] = []
    detail: list[str] = []
    start = stream[i][0]
    n = len(stream)
    child: list[str] = []
    while i < n:
        text = stream[i][1]
        if not text.startswith("Traceback (most recent call last):"):
            break
        detail.append(text)
        i += 1
        while i < n:
            text = stream[i][1]
            m = _FRAME.match(text)
            if m:
                frames.append((m.group(1), int(m.group(2)), m.group(3)))
            elif not (text.startswith("    ") or text.strip() == ""):
                break
            detail.append(text)
            i += 1
        if i >= n:
            break
        text = stream[i][1]
        detail.append(text)
        messages.append(text.strip())
        i += 1
        if "ChildFailedError" in text:
            child, i = _child_block(stream, i)  # torchrun's report follows
            break
        # A chained exception: "During handling ..." then another traceback.
        j = i
        while j < n and stream[j][1].strip() == "":
            j += 1
        if j < n and stream[j][1].startswith(_CHAIN):
            j += 1
            while j < n and stream[j][1].strip() == "":
                j += 1
            if j < n and stream[j][1].startswith("Traceback"):
                i = j
                continue
        break
    if not messages:
        return None, i
    kind = classify(messages, frames)
    uf = user_frame(frames)
    ev = Event(
        kind=kind,
        message=_shorten(messages[-1]),
        source=source,
        rank=rank,
        where=f"{uf[0]}:{uf[1]}" if uf else None,
        line=start,
        detail=detail[-40:],
    )
    if kind == "child_failed":
        ev.where = None  # torchrun's own frames: not where anything went wrong
        _child_failed(ev, child)
    if kind in OOM_KINDS:
        ev.hint = MEMORY_HINT
    return ev, i


def _child_failed(ev: Event, block: list[str]) -> None:
    """torchrun's "Root Cause (first observed failure)" and failures: who, exit code."""
    entries: list[dict] = []
    root_at = None
    cur: dict | None = None
    for text in block:
        if text.startswith("Root Cause"):
            root_at = len(entries)
        if re.match(r"^\[\d+\]:\s*$", text):
            cur = {}
            entries.append(cur)
            continue
        m = _FAILURE_FIELD.match(text)
        if m and cur is not None:
            cur[m.group(1)] = m.group(2).strip()
    failures = []
    for k, e in enumerate(entries):
        rank = _int(re.match(r"(-?\d+)", e.get("rank", "")))
        code = _int(re.match(r"(-?\d+)", e.get("exitcode", "")))
        pid = _int(re.search(r"pid: (\d+)", e.get("exitcode", "")))
        tm = _TORCHRUN_TIME.match("time : " + e.get("time", ""))
        when = None
        if tm:
            y, mo, d, hh, mm, ss = (int(x) for x in tm.groups())
            when = _time.mktime((y, mo, d, hh, mm, ss, 0, 0, -1))
        failures.append({"rank": rank, "exit_code": code, "pid": pid, "time": when,
                         "root": k == root_at, "host": e.get("host")})  # fmt: skip
    ev.detail = ev.detail + block
    ev.failures = failures
    root = next((f for f in failures if f["root"]), None)
    if root is not None:
        ev.names_rank = root["rank"]
        ev.exit_code = root["exit_code"]
        ev.message = (
            f"ChildFailedError: torchrun names rank {root['rank']} "
            f"({describe_code(root['exit_code'])}) as the first failure"
        )


def _single_line(source, rank, stream, i, t) -> Event | None:
    lineno, text = stream[i]
    m = _TERMINATE.search(text)
    if m:
        what = ""
        for _, nxt in stream[i + 1 : i + 4]:
            w = _WHAT.match(nxt)
            if w:
                what = w.group(1).strip()
                break
        kind = classify([what]) if what else "native_abort"
        if kind not in ("collective_mismatch", "cuda_oom", "cpu_oom"):
            kind = "native_abort"
        msg = f"{m.group(1)}: {what}" if what else f"terminate called ({m.group(1)})"
        ev = Event(kind, _shorten(msg), source, rank, line=lineno, time=t, sender=None)
        ev.detail = [x for _, x in stream[i : i + 4]]
        ev.exit_code = -int(_signal.SIGABRT)
        return ev
    m = _SLURM_CANCEL.search(text)
    if m:
        why = (m.group(5) or "").strip()
        sender = {
            "TIME LIMIT": "Slurm time limit",
            "PREEMPTION": "Slurm preemption",
            "NODE FAILURE": "Slurm node failure",
        }.get(why, f"Slurm cancel ({why.lower()})" if why else "Slurm cancel (scancel)")
        when = _slurm_time(m.group(4))
        if m.group(1) == "STEP" and not why:
            # Slurm ends a step's other tasks once one task failed (--kill-on-bad-exit): the
            # consequence of that failure, not a stop from outside.
            return Event("stopped_by_launcher", _shorten(text.strip(" *")), source, rank,
                         line=lineno, time=when or t)  # fmt: skip
        return Event("signal", _shorten(text.strip(" *")), source, rank, line=lineno,
                     time=when or t, sender=sender)  # fmt: skip
    m = _SLURM_OOM.search(text)
    if m:
        return Event("oom_killer", _shorten(text.strip()), source, rank, line=lineno, time=t,
                     sender="Slurm (the step's cgroup)", hint=MEMORY_HINT)  # fmt: skip
    m = _NCCL_WATCHDOG.search(text)
    if m:
        return Event("collective_timeout", _shorten("Watchdog caught collective operation timeout: "
                     + m.group(1)), source, rank, line=lineno, time=t)  # fmt: skip
    if _TEARDOWN.search(text):
        return Event("teardown_warning", _shorten(_after_warning(text)), source, rank,
                     line=lineno, time=t)  # fmt: skip
    m = _OUR_STOP.match(text)
    if m:
        return Event("signal", f"{m.group(1)} to the job's torchrun", source, rank,
                     line=lineno, time=t)  # fmt: skip
    return None


def _after_warning(text: str) -> str:
    i = text.find("WARNING:")
    return text[i:] if i >= 0 else text


def _slurm_time(s: str) -> float | None:
    m = re.match(r"(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)", s)
    if not m:
        return None
    return _time.mktime(tuple(int(x) for x in m.groups()) + (0, 0, -1))


def _shorten(s: str, n: int = 400) -> str:
    s = s.strip()
    return s if len(s) <= n else s[: n - 1] + "…"


def _int(m) -> int | None:
    return int(m.group(1)) if m else None


def describe_code(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0 or code > 128:
        num = -code if code < 0 else code - 128
        try:
            return f"killed by {_signal.Signals(num).name}"
        except ValueError:
            pass
    return f"exit code {code}"


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
    scheduler: str | None = None,
) -> list[Event]:
    """What a job record says: who stopped the job (areal stop, Ctrl-C, Slurm), and which
    server exited. `servers`: (label, exit code[, address])."""
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
    elif state == "killed" and _killed_by(scheduler):
        sender = _killed_by(scheduler)
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


def _killed_by(scheduler: str | None) -> str | None:
    """Who ends a job that its record calls killed, as the job's scheduler declares."""
    if not scheduler:
        return None
    from areal_cli import schedulers
    from areal_cli.errors import UsageError

    try:
        return schedulers.scheduler_class(scheduler).killed_by
    except UsageError:
        return None


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
    primary = [e for e in events if not e.secondary_kind and e.kind != "signal"
               and e not in external]  # fmt: skip
    signals = [e for e in events if e.kind == "signal" and e not in external]
    named = next((e.names_rank for e in events if e.names_rank is not None), None)

    if external:
        root = min(external, key=lambda e: (e.time or float("inf"), e.order))
    elif primary:
        if all(e.time is not None for e in primary):
            root = min(primary, key=lambda e: (e.time, e.order))
        else:
            root = min(primary, key=lambda e: (e.kind != "server_died", e.rank != named,
                                               e.order))  # fmt: skip
    elif signals:
        root = min(signals, key=lambda e: (e.rank != named, e.time or float("inf"), e.order))
    else:
        # Only consequences: the one that is itself the failure (a hang that timed out),
        # torchrun's summary last.
        rank_of = {"server_error": 0, "collective_timeout": 1, "connection_lost": 2}
        root = min(events, key=lambda e: (rank_of.get(e.kind, 3), e.time or float("inf"),
                                          e.order))  # fmt: skip
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
    return Report(root, secondary)


def _node_of(rank: int, events: Sequence[Event]) -> str | None:
    """The node whose torchrun (its log torchrun-<node>.log) reported the rank's failure."""
    for e in events:
        if e.source.startswith("torchrun-") and any(f["rank"] == rank for f in e.failures):
            return e.source.removeprefix("torchrun-")
    return None


def _same(a: Event, b: Event) -> bool:
    return a.kind == b.kind and a.message == b.message and a.where == b.where


def _from_torchrun_report(events: list[Event], kernel: Kernel | None) -> list[Event]:
    """A rank that a signal killed writes nothing: torchrun's report says so. One event per
    such rank with no failure of its own in its log; SIGTERM is torchrun stopping the peers
    of the first failure."""
    out: list[Event] = []
    own = {e.rank for e in events if not e.secondary_kind and e.rank is not None}
    slurm_oom = [e for e in events if e.kind == "oom_killer" and e.rank is None]
    for e in events:
        for f in e.failures:
            code, rank = f["exit_code"], f["rank"]
            if code is None or rank is None or rank in own:
                continue
            sig = -code if code < 0 else (code - 128 if code > 128 else 0)
            if not sig:
                continue
            if sig == _signal.SIGTERM:
                continue  # torchrun's own teardown of the survivors
            ev = Event("signal", f"rank {rank} {describe_code(code)} (pid {f['pid']})",
                       e.source, rank, line=e.line, time=f["time"], pid=f["pid"],
                       exit_code=code, order=e.order, path=e.path)  # fmt: skip
            if sig == _signal.SIGKILL:
                _kernel_verdict(ev, kernel, slurm_oom)
            elif sig == _signal.SIGABRT:
                ev.kind = "native_abort"
            own.add(rank)
            out.append(ev)
    return out


def _kernel_verdict(ev: Event, kernel: Kernel | None, slurm_oom: Sequence[Event] = ()) -> None:
    """A SIGKILL is the OOM killer's when the kernel's log names that pid, or when Slurm saw
    an OOM kill in the step (on a node whose kernel log is not here); otherwise it came
    from someone (the cgroup's count says whether the OOM killer acted at all)."""
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


def parse_files(paths: Sequence[tuple[str, Path]], max_bytes: int = 4 << 20) -> list[Event]:
    """Events of several logs (label, path): each log's order kept, logs in the given order.
    Only a log's last `max_bytes` are read (the failure is at its end)."""
    events: list[Event] = []
    for k, (label, path) in enumerate(paths):
        try:
            with open(path, "rb") as f:
                f.seek(0, 2)
                size = f.tell()
                f.seek(max(0, size - max_bytes))
                text = f.read().decode(errors="replace")
            year = _time.localtime(Path(path).stat().st_mtime).tm_year
        except OSError:
            continue
        for e in parse_log(label, text.splitlines(), rank=label_rank(label), year=year):
            e.order = (k, *e.order)
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
    from areal_cli import logfiles

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
    from areal_cli import logfiles

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
