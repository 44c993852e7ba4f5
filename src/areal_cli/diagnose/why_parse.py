"""Reading one log for `doctor why`: its failures as events, in its order.

Each stream of lines (one process's: why_lines tells them apart) is read front to back. A
traceback becomes one event (its chain, Ray's remote part, torchrun's report that follows it);
any other line is tried against LINE_RULES, a table of one rule per shape of line (C++
terminate, NCCL's watchdog, Slurm, the launchers' one-line reports, the kernel's OOM killer,
Ray's memory monitor, an exception line alone). A launcher's own traceback only carries a
child's failure: it becomes that report, never the root cause (why.analyze decides that).
"""

from __future__ import annotations

import functools
import re
import signal as _signal
import time as _time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from areal_cli.diagnose.jsonfields import json_fields
from areal_cli.diagnose.why_kinds import SECONDARY_KINDS, classify
from areal_cli.diagnose.why_lines import exception_line, filler, split_line

OOM_KINDS = ("cpu_oom", "cuda_oom", "oom_killer")
MEMORY_HINT = "next: `areal doctor memory` shows what held the memory"
_PREFIX = re.compile(r"^\[(?:default|rank)(\d+)\]:\s?")
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (.+)$')
_TB = "Traceback (most recent call last):"
_CHAIN = ("During handling of the above exception", "The above exception was the direct cause")
_TERMINATE = re.compile(r"terminate called after throwing an instance of '([^']+)'")
_WHAT = re.compile(r"^\s*what\(\):\s*(.*)$")
_SLURM_CANCEL = re.compile(
    r"\*\*\* (JOB|STEP) ([\w.+]+) ON (\S+) CANCELLED AT (\S+)(?: DUE TO ([A-Z ]+?))?(?: \*\*\*|$)"
)
_TEARDOWN = re.compile(
    r"destroy_process_group\(\) was not called|process group has NOT been destroyed"
)
# Timestamps as the logs write them: glog (torch's C++ and torchrun), AReaL, Python logging.
_GLOG = re.compile(r"^\[?[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)(\.\d+)?\s")
_AREAL_TS = re.compile(r"^(\d{4})(\d\d)(\d\d)-(\d\d):(\d\d):(\d\d)(\.\d+)?\s")
_PY_TS = re.compile(r"^\[?(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:[,.](\d+))?")
_TORCHRUN_TIME = re.compile(r"^\s*time\s*:\s*(\d{4})-(\d\d)-(\d\d)_(\d\d):(\d\d):(\d\d)")
_FAILURE_FIELD = re.compile(r"^\s*(rank|exitcode|host|time|traceback|error_file)\s*:\s*(.*)$")
_ENTRY = re.compile(r"^\s*\[\d+\]:\s*$")  # `[1]:`, an entry of torchrun's failures block
_REPORT_LINE = re.compile(
    r"^\s*(?:\[\d+\]:|Root Cause \(first observed failure\):|Failures:|<NO_OTHER_FAILURES>"
    r"|[=-]{8,}|\S+ FAILED)\s*$"
)
# A launcher's own frames (torchrun, torch.distributed.launch/run, accelerate, deepspeed,
# runpy, a console script): the messenger of a child's failure, never where it happened.
_LAUNCHER_FRAME = re.compile(
    r"/bin/[\w.-]+$|<frozen runpy>|/runpy\.py$|torch/distributed/(?:run|launch)\.py$"
    r"|torch/distributed/(?:elastic|launcher)/|accelerate/commands/|deepspeed/launcher/"
    r"|[\\/]torch[\\/]distributed[\\/](?:run|launch)\.py$"
)
# A launcher's exception about a child: `CalledProcessError: Command '[…]' died with
# <Signals.SIGSEGV: 11>.` (torch.distributed.launch) or `… returned non-zero exit status 1.`
_CALLED = re.compile(
    r"CalledProcessError: Command '(?P<cmd>.*)' (?:died with <Signals\.\w+: (?P<sig>\d+)>"
    r"|returned non-zero exit status (?P<code>-?\d+))"
)
_LOCAL_RANK = re.compile(r"--local[_-]rank[= ',]+(\d+)")


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
    failures: list[dict] = field(default_factory=list)  # a launcher's report: rank, exit code
    path: str | None = None  # the log file it is in
    node: str | None = None  # where the rank ran, where a node's torchrun log says
    order: tuple = ()  # where it sits in the logs' own order
    cut: bool = False  # a traceback the log ends inside: its exception is not known

    @property
    def secondary_kind(self) -> bool:
        return self.kind in SECONDARY_KINDS

    def short(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else self.source
        at = f" at {self.where}" if self.where else ""
        return f"{who}: {self.kind}: {self.message}{at}"

    def to_json(self) -> dict:
        out = json_fields(self, "rank source kind message where")
        extra = json_fields(self, "line path time exit_code sender node ranks caused_by hint")
        # What the event does not know (None, no other rank) is left out.
        out.update({k: v for k, v in extra.items() if v is not None and v != []})
        return out


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


def user_frame(frames: Sequence[tuple[str, int, str]]) -> tuple[str, int, str] | None:
    """The innermost frame of the user's code: not the standard library, not an installed
    package (site-packages), not torch itself, not a launcher."""
    for f in reversed(frames):
        path = f[0]
        if "/areal_cli/templates/" in path:
            return f  # our example scripts are the user's code (verdict.TEMPLATES)
        if path.startswith("<") or "site-packages/" in path or "dist-packages/" in path:
            continue
        if re.search(r"/lib/python3\.\d+/", path) or "/torch/" in path:
            continue
        if _LAUNCHER_FRAME.search(path):
            continue
        return f
    return frames[-1] if frames else None


def _launcher_only(frames: Sequence[tuple[str, int, str]]) -> bool:
    return bool(frames) and all(_LAUNCHER_FRAME.search(f[0]) for f in frames)


def parse_log(
    source: str, lines: Iterable[str], rank: int | None = None, year: int | None = None
) -> list[Event]:
    """The failures one log shows, in its order. `rank`: the log's own rank (rank-N.log);
    lines a launcher prefixed with a rank (a combined torchrun, vLLM or Ray log) count for
    that rank, and each prefixed process's lines are read as one stream."""
    lines = list(lines)
    year = _year_in(lines) or year
    streams: dict[tuple, list[tuple]] = {}
    for n, raw in enumerate(lines, 1):
        ln = split_line(raw, rank)
        if ln is not None:
            streams.setdefault(ln.stream, []).append((n, ln.text, ln.rank, ln.head))
    events: list[Event] = []
    for stream in streams.values():
        events += _parse_stream(source, stream, year)
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


@dataclass
class _Ctx:
    """Where a rule looks: the stream, the line, its rank (and, when asked, its time)."""

    source: str
    stream: list[tuple]  # (line number, text, rank, head)
    i: int
    rank: int | None
    year: int | None = None

    @property
    def lineno(self) -> int:
        return self.stream[self.i][0]

    @functools.cached_property
    def time(self) -> float | None:
        return _stream_time(self.stream[self.i], self.year)

    def event(self, kind: str, message: str, **kw) -> Event:
        kw.setdefault("rank", self.rank)
        return Event(kind, _shorten(message), self.source, line=self.lineno, time=self.time, **kw)


def _stream_time(item: tuple, year: int | None) -> float | None:
    """The time a line says (in the prefixes taken off it, or at its start)."""
    _, text, _, head = item
    t = line_time(head.lstrip("[(").strip(), year) if head else None
    return t if t is not None else line_time(text, year)


def _parse_stream(source: str, stream: list[tuple], year) -> list[Event]:
    out: list[Event] = []
    i, n = 0, len(stream)
    while i < n:
        text = stream[i][1]
        # Most lines are none of these: cheap tests of their words first, patterns after.
        if _TB in text or (
            ('File "' in text and _FRAME.match(text))
            or ("RayTaskError" in text and _RAY_TASK.match(text.lstrip()))
        ):
            # A traceback: its header (mid-line after SGLang's "Scheduler hit an exception: "),
            # or its frames where the paste lost the header, or Ray's remote one.
            start = i
            ev, i = _traceback(_Ctx(source, stream, i, stream[i][2], year))
            if ev is not None:
                # The last timestamped line just before a traceback dates it (a lower bound,
                # so only when it is close).
                for k in range(start - 1, max(i - 40, -1), -1):
                    if ev.time is not None:
                        break
                    ev.time = _stream_time(stream[k], year)
                out.append(ev)
            continue
        child = text.startswith(_CHILD_FAILED)
        if child or (text.lstrip()[:1] in _REPORT_FIRST and _report_start(stream, i)):
            # torchrun's report without its traceback (a log that starts or was cut there).
            block, j = _child_block(stream, i + 1 if child else i)
            ctx = _Ctx(source, stream, i, stream[i][2], year)
            ev = ctx.event("child_failed", text.strip() or "torchrun's failure report")
            _child_failed(ev, block)
            out.append(ev)
            i = max(j, i + 1)
            continue
        if _ANY_RULE.search(text) is not None:
            ev = _line_event(_Ctx(source, stream, i, stream[i][2], year), text)
            if ev is not None:
                out.append(ev)
        i += 1
    return out


def _line_event(ctx: _Ctx, text: str) -> Event | None:
    """The event of the first rule of LINE_RULES that makes one of this line."""
    for needles, rx, rule in LINE_RULES:
        if needles[0] not in text and (
            len(needles) == 1 or not any(x in text for x in needles[1:])
        ):
            continue  # the rule's words are not in the line: no need for its pattern
        m = rx.search(text)
        if m:
            ev = rule(ctx, m)
            if ev is _TAKEN:
                return None
            if ev is not None:
                return ev
    return None


_REPORT_FIRST = ("r", "e", "h", "t", "R", "[")  # how the lines of torchrun's report begin


_CHILD_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
_RAY_TASK = re.compile(r"^(?:[\w.]+\.)?RayTaskError\(\w+\): ")


def _report_start(stream, i) -> bool:
    """A torchrun failures block that a paste cut from its ChildFailedError line: its entry
    header, its Root Cause line, or its `rank : N (local_rank: M)` field."""
    text = stream[i][1]
    if text.startswith("Root Cause (first observed failure)"):
        return True
    m = _FAILURE_FIELD.match(text)
    if m is None and _ENTRY.match(text):
        m = _FAILURE_FIELD.match(stream[i + 1][1]) if i + 1 < len(stream) else None
    return m is not None and (m.group(1) != "traceback")


def _child_block(stream, i) -> tuple[list[str], int]:
    """torchrun's failures block from stream[i] to its closing rule (or its last line)."""
    block: list[str] = []
    while i < len(stream):
        text = stream[i][1]
        if text.startswith("Traceback") or not (_FAILURE_FIELD.match(text)
                                                or _REPORT_LINE.match(text)):  # fmt: skip
            break
        block.append(text)
        i += 1
        if text.startswith("=") and len(block) > 2:
            break
    return block, i


@dataclass
class _Tb:
    """One traceback as read, with its chained ones."""

    frames: list[tuple[str, int, str]] = field(default_factory=list)  # (file, line, function)
    messages: list[str] = field(default_factory=list)  # each exception line, outermost last
    detail: list[str] = field(default_factory=list)  # its lines as the log has them
    child: list[str] = field(default_factory=list)  # torchrun's failures block after it


def _traceback(ctx: _Ctx) -> tuple[Event | None, int]:
    """A Python traceback (with its chained ones) from stream[i]: one event, and where the
    scan goes on. Read as pasted: a header in mid-line, frames without their header, code
    lines that lost their indentation (the exception is the `Name: message` line after the
    last frame), an abridged `[...]`, a log that ends inside it; Ray's RayTaskError(X) line
    is followed by the remote task's frames, and those are where it failed."""
    tb, i = _read_traceback(ctx.stream, ctx.i)
    return _traceback_event(ctx, tb, i)


def _read_traceback(stream, i: int) -> tuple[_Tb, int]:
    """Its frames, exception lines and detail from stream[i], and where it ends."""
    n = len(stream)
    tb = _Tb()
    while i < n:
        text = stream[i][1]
        if _TB in text:
            tb.detail.append(text)
            i += 1
        elif _RAY_TASK.match(text.strip()):
            tb.messages.append(text.strip())
            tb.detail.append(text)
            tb.frames = []  # the driver's ray.get only carried it: the remote frames follow
            i += 1
        message, i = _read_frames(stream, i, tb)
        if message is None:
            break
        tb.detail.append(stream[i][1])
        i += 1
        if _RAY_TASK.match(message):
            tb.messages.append(message)
            tb.frames = []
            continue  # the remote task's frames and its exception follow
        tb.messages.append(message)
        if "ChildFailedError" in message:
            tb.child, i = _child_block(stream, i)  # torchrun's report follows
            break
        chained = _chained(stream, i)
        if chained is None:
            break
        i = chained
    return tb, i


def _read_frames(stream, i: int, tb: _Tb) -> tuple[str | None, int]:
    """Frames (into `tb`) up to the exception's line: (that line, its index), or (None, where
    the frames end) when the traceback is cut before its exception."""
    last = "frame"
    while i < len(stream):
        text = stream[i][1]
        m = _FRAME.match(text)
        if m:
            tb.frames.append((m.group(1), int(m.group(2)), m.group(3)))
            last = "frame"
        elif text.strip() == "" or filler(text):
            pass
        elif text[:1] in (" ", "\t") and last in ("frame", "code"):
            last = "code"
        elif _TB in text or text.startswith(_CHAIN):
            break  # a new traceback: this one was cut before its exception
        elif exception_line(text) or last != "frame":
            return text.strip(), i
        else:
            last = "code"  # the code line under a frame, its indentation lost
        tb.detail.append(text)
        i += 1
    return None, i


def _chained(stream, i: int) -> int | None:
    """Where a chained exception's traceback starts ("During handling ..." then another
    traceback) after stream[i], else None."""
    n = len(stream)
    j = i
    while j < n and stream[j][1].strip() == "":
        j += 1
    if j < n and stream[j][1].startswith(_CHAIN):
        j += 1
        while j < n and stream[j][1].strip() == "":
            j += 1
        if j < n and _TB in stream[j][1]:
            return j
    return None


def _traceback_event(ctx: _Ctx, tb: _Tb, i: int) -> tuple[Event | None, int]:
    """The event of a traceback read from stream[ctx.i] up to stream[i]."""
    first = ctx.stream[ctx.i][1]
    context = first[: first.index(_TB)].strip().rstrip(":").strip() if _TB in first else ""
    frames, messages, detail = tb.frames, tb.messages, tb.detail
    cut = False
    if not messages:
        if not frames or not (context or _TB in first):
            return None, max(i, ctx.i + 1)
        # The log ends (or the paste was cut) inside the traceback: still a failure there.
        messages = [(context + ": " if context else "")
                    + "the exception is not in the log (its traceback is cut)"]  # fmt: skip
        cut = True
    called = _CALLED.search(messages[-1])
    if called or _launcher_only(frames):
        # A launcher's traceback only carries a child's failure: never the root cause.
        ev = Event("child_failed", _shorten(messages[-1]), ctx.source, ctx.rank,
                   line=ctx.lineno, time=ctx.time, detail=detail[-40:])  # fmt: skip
        if called:
            _called_process(ev, called)
        _child_failed(ev, tb.child)
        return ev, i
    kind = classify(messages, frames)
    uf = user_frame(frames)
    ev = Event(
        kind=kind,
        message=_shorten(messages[-1]),
        source=ctx.source,
        rank=ctx.rank,
        where=f"{uf[0]}:{uf[1]}" if uf else None,
        line=ctx.lineno,
        detail=detail[-40:],
        time=ctx.time,
        cut=cut,
    )
    if kind == "child_failed":
        ev.where = None  # torchrun's own frames: not where anything went wrong
        _child_failed(ev, tb.child)
    if kind in OOM_KINDS:
        ev.hint = MEMORY_HINT
    return ev, i


def _called_process(ev: Event, m: re.Match) -> None:
    """A launcher's CalledProcessError: the child's exit (a signal or a code) and its rank."""
    code = -int(m.group("sig")) if m.group("sig") else int(m.group("code"))
    rank = _int(_LOCAL_RANK.search(m.group("cmd")))
    ev.failures = [{"rank": rank, "exit_code": code, "pid": None, "time": ev.time,
                    "root": True, "host": None}]  # fmt: skip


def _child_failed(ev: Event, block: list[str]) -> None:
    """torchrun's "Root Cause (first observed failure)" and failures: who, exit code."""
    entries: list[dict] = []
    root_at = None
    cur: dict | None = None
    for text in block:
        if text.startswith("Root Cause"):
            root_at = len(entries)
            cur = None
        if _ENTRY.match(text):
            cur = {}
            entries.append(cur)
            continue
        m = _FAILURE_FIELD.match(text)
        if m:
            if cur is None or m.group(1) in cur:
                cur = {}  # a field without its entry's header: a paste cut above it
                entries.append(cur)
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
    ev.failures = ev.failures + failures
    root = next((f for f in failures if f["root"]), None)
    if root is not None:
        ev.names_rank = root["rank"]
        ev.exit_code = root["exit_code"]
        ev.message = (
            f"ChildFailedError: torchrun names rank {root['rank']} "
            f"({describe_code(root['exit_code'])}) as the first failure"
        )


# -- single lines ------------------------------------------------------------------------------
# One rule per shape of line, tried in this order; the first that matches a line makes its
# event (or decides it is none).


def _rank_in(text: str, rank: int | None) -> int | None:
    """The rank a line of torch's C++ names (`[Rank 5]`, `[PG 3 Rank 5]`), where the line's
    prefix did not say."""
    if rank is not None:
        return rank
    m = re.search(r"\bRank (\d+)\]", text)
    return int(m.group(1)) if m else None


def _native(ctx: _Ctx, what: str, thrown: str | None) -> Event:
    """C++ terminate / an unhandled exception's what(): its kind from its text (the NCCL
    watchdog's says a timeout, a CUDA error, a lost peer), else a native abort."""
    inner = re.search(r"watchdog thread terminated with exception: (.*)", what)
    kind = classify([inner.group(1) if inner else what]) if what else "native_abort"
    if kind in ("python_exception", "child_failed", "launcher_failed", "signal"):
        kind = "native_abort"
    if what:
        msg = f"{thrown}: {what}" if thrown else what
    else:
        msg = f"terminate called ({thrown})"
    ev = ctx.event(kind, msg, rank=_rank_in(what, ctx.rank))
    ev.detail = [x[1] for x in ctx.stream[ctx.i : ctx.i + 4]]
    ev.exit_code = -int(_signal.SIGABRT)
    if kind in OOM_KINDS:
        ev.hint = MEMORY_HINT
    return ev


def _terminate(ctx: _Ctx, m: re.Match) -> Event:
    what = ""
    for _, nxt, *_ in ctx.stream[ctx.i + 1 : ctx.i + 4]:
        w = _WHAT.match(nxt)
        if w:
            what = w.group(1).strip()
            break
    return _native(ctx, what, m.group(1))


_TAKEN = object()  # a rule's answer for a line that belongs to an event already made


def _what(ctx: _Ctx, m: re.Match):
    prev = ctx.stream[ctx.i - 1][1] if ctx.i else ""
    if _TERMINATE.search(prev):
        return _TAKEN  # the terminate line before it made the event
    thrown = re.search(r"Unhandled exception: (\S+?)\.? what\(\)", ctx.stream[ctx.i][1])
    return _native(ctx, m.group(1).strip(), thrown.group(1) if thrown else None)


def _watchdog_ended(ctx: _Ctx, m: re.Match) -> Event:
    text = ctx.stream[ctx.i][1]
    return _native(ctx, text[text.find("Process group watchdog") :], None)


def _slurm_cancel(ctx: _Ctx, m: re.Match) -> Event:
    why = (m.group(5) or "").strip()
    sender = {
        "TIME LIMIT": "Slurm time limit",
        "PREEMPTION": "Slurm preemption",
        "NODE FAILURE": "Slurm node failure",
    }.get(why, f"Slurm cancel ({why.lower()})" if why else "Slurm cancel (scancel)")
    when = _slurm_time(m.group(4)) or ctx.time
    text = ctx.stream[ctx.i][1].strip(" *")
    if m.group(1) == "STEP" and not why:
        # Slurm ends a step's other tasks once one task failed (--kill-on-bad-exit): the
        # consequence of that failure, not a stop from outside.
        ev = ctx.event("stopped_by_launcher", text)
    else:
        ev = ctx.event("signal", text, sender=sender)
    ev.time = when
    return ev


def _report(ctx: _Ctx, rank, code, pid, what: str, names: bool = True) -> Event:
    """A launcher's one-line report that a child ended: a failures entry, which analyze
    turns into the rank's signal or exit code when the rank says nothing itself."""
    ev = ctx.event("child_failed", what, rank=None)
    ev.failures = [{"rank": rank, "exit_code": code, "pid": pid, "time": ctx.time,
                    "root": names, "host": None}]  # fmt: skip
    ev.exit_code = code
    if names and rank is not None:
        ev.names_rank = rank
    return ev


def _torchrun_line(ctx: _Ctx, m: re.Match) -> Event:
    # `failed (exitcode: -9) local_rank: 0 (pid: 1322) of binary: …`, in torchrun's three
    # forms (ERROR:torch.distributed…, E1219 … api.py:882], [time] torch… [ERROR]).
    code, rank, pid = int(m.group(1)), int(m.group(2)), int(m.group(3))
    ev = _report(ctx, rank, code, pid, f"torchrun: local_rank {rank} failed "
                 f"({describe_code(code)}, pid {pid})")  # fmt: skip
    # A local rank: on a node after the first, the global rank is in the failures block.
    ev.failures[0]["local"] = True
    return ev


def _deepspeed_line(ctx: _Ctx, m: re.Match) -> Event:
    # `[launch.py:434:sigkill_handler] ['python', '-u', 'main.py', '--local_rank=0', …]
    # exits with return code = -9`
    code = int(m.group(1))
    rank = _int(_LOCAL_RANK.search(ctx.stream[ctx.i][1]))
    who = f"local_rank {rank}" if rank is not None else "a rank"
    return _report(ctx, rank, code, None, f"deepspeed: {who} exited ({describe_code(code)})")


def _srun_line(ctx: _Ctx, m: re.Match) -> Event:
    # `srun: error: node1: tasks 2-7: Exited with exit code 1` (or `task 3: Killed`).
    node, tasks, how, code = m.group(1), m.group(2), m.group(3), m.group(4)
    code = int(code) if code else -{"Killed": 9, "Segmentation fault": 11,
                                    "Aborted": 6}.get(how.strip(), 15)  # fmt: skip
    rank = int(tasks) if tasks.isdigit() else None  # several tasks: no one rank to name
    ev = _report(ctx, rank, code, None, f"srun: task{'s' if rank is None else ''} "
                 f"{tasks} on {node}: {how.strip()}", names=False)  # fmt: skip
    ev.failures[0]["srun"] = True  # a task number: a rank only where srun started the ranks
    return ev


def _argparse(ctx: _Ctx, m: re.Match) -> Event:
    return ctx.event("config_error", ctx.stream[ctx.i][1].strip())


def _kernel_kill(ctx: _Ctx, m: re.Match) -> Event:
    ev = ctx.event("oom_killer", ctx.stream[ctx.i][1].strip(), pid=int(m.group(1)),
                   sender="the kernel's OOM killer", hint=MEMORY_HINT)  # fmt: skip
    return ev


def _ray_memory(ctx: _Ctx, m: re.Match) -> Event:
    return ctx.event("oom_killer", ctx.stream[ctx.i][1].strip(),
                     sender="Ray's memory monitor", hint=MEMORY_HINT)  # fmt: skip


def _died(ctx: _Ctx, m: re.Match) -> Event:
    return ctx.event("process_died", ctx.stream[ctx.i][1].strip())


def _bare_exception(ctx: _Ctx, m: re.Match) -> Event | None:
    """An exception line without its traceback (the rank's last line alone, a paste)."""
    text = ctx.stream[ctx.i][1].strip()
    if exception_line(text, strict=True) is None:
        return None
    called = _CALLED.search(text)
    if called:
        ev = ctx.event("child_failed", text)
        _called_process(ev, called)
        return ev
    kind = classify([text])
    ev = ctx.event(kind, text)
    if kind in OOM_KINDS:
        ev.hint = MEMORY_HINT
    return ev


def _error_text(ctx: _Ctx, m: re.Match) -> Event | None:
    """A logged error whose text names a failure of a kind that is no Python exception's
    (a collective mismatch, a CUDA OOM or error) in mid-line."""
    text = ctx.stream[ctx.i][1].strip()
    kind = classify([text])
    if kind not in ("collective_mismatch", "cuda_oom", "cuda_error"):
        return None
    return ctx.event(kind, text)


_E = ("error", "Error", "ERROR")
# (words one of which the line must hold, its pattern, the rule)
LINE_RULES: list[tuple[tuple[str, ...], re.Pattern, object]] = [
    (("terminate called",), _TERMINATE, _terminate),
    (("what()",), re.compile(r"\bwhat\(\):\s*(.*)$"), _what),
    (
        ("watchdog thread",),
        re.compile(r"Process group watchdog thread terminated with exception: "),
        _watchdog_ended,
    ),  # fmt: skip
    (("CANCELLED AT",), _SLURM_CANCEL, _slurm_cancel),
    # slurmstepd, when the step's cgroup saw the kernel's OOM killer (21.08+ and older wording).
    (
        ("oom",),
        re.compile(r"Detected (\d+) oom[-_]kill event"),
        lambda ctx, m: ctx.event(
            "oom_killer",
            ctx.stream[ctx.i][1].strip(),
            hint=MEMORY_HINT,
            sender="Slurm (the step's cgroup)",
        ),
    ),  # fmt: skip
    (
        ("Watchdog caught",),
        re.compile(r"Watchdog caught collective operation timeout: (.*)"),
        lambda ctx, m: ctx.event(
            "collective_timeout",
            "Watchdog caught collective operation timeout: " + m.group(1),
            rank=_rank_in(ctx.stream[ctx.i][1], ctx.rank),
        ),
    ),  # fmt: skip
    (
        ("destroy",),
        _TEARDOWN,
        lambda ctx, m: ctx.event("teardown_warning", _after_warning(ctx.stream[ctx.i][1])),
    ),
    # our torchrun runner, when it is stopped
    (
        ("stopping: ",),
        re.compile(r"^stopping: (SIG\w+)$"),
        lambda ctx, m: ctx.event("signal", f"{m.group(1)} to the job's torchrun"),
    ),
    (
        ("failed (exitcode",),
        re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)"),
        _torchrun_line,
    ),  # fmt: skip
    (
        ("exits with return code",),
        re.compile(r"sigkill_handler.*exits with return code = (-?\d+)"),
        _deepspeed_line,
    ),
    (
        ("srun: error",),
        re.compile(
            r"^srun: error: (\S+): tasks? ([\d,-]+): (Exited with exit code (\d+)|"
            r"Killed|Segmentation fault|Aborted|Terminated)"
        ),
        _srun_line,
    ),  # fmt: skip
    ((": error: ",), re.compile(r"^[\w.-]+\.py: error: "), _argparse),
    (
        ("Killed process",),
        re.compile(r"(?:Out of memory|Memory cgroup out of memory): Killed process (\d+)"),
        _kernel_kill,
    ),  # fmt: skip
    (("memory pressure",), re.compile(r"killed due to memory pressure"), _ray_memory),
    (
        ("died", "dead because"),
        re.compile(
            r"A worker died or was killed while executing a task|Worker proc \S+ died "
            r"unexpectedly|The actor is dead because its worker process has died"
        ),
        _died,
    ),  # fmt: skip
    # An exception line alone: its class says it is one (why_lines.exception_line, strict).
    (
        ("Error", "Exception", "Interrupt", "Exit", "Failure", "Fault", "Abort"),
        re.compile(r"^\s*[\w.]+(?:\(\w+\))?: "),
        _bare_exception,
    ),  # fmt: skip
    (_E, re.compile(r"\berror\b", re.I), _error_text),
]


_ANY_RULE = re.compile("|".join(re.escape(x) for needles, _, _ in LINE_RULES for x in needles))


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
