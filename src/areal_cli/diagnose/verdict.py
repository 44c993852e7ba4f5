"""From per-rank stacks to a hang verdict. Pure: operates on parsed dumps, touches nothing.

Per rank, the thread of interest is the main thread (or, when only another thread sits in a
collective, that one). Its state is one of

    collective  blocked in a torch.distributed call (all_reduce, all_gather_single, barrier,
                init_process_group, ...: the names come from torch, see collectives.py)
    busy        on CPU (py-spy reports the thread active) outside a collective
    idle        blocked elsewhere (queue, lock, sleep, data loader)
    missing     the process is gone
    stopped     the process is stopped (state T: SIGSTOP, Ctrl-Z); its stack, read without
                attaching, is where it stopped
    error       py-spy could not read it

With several samples a rank has moved when its stack changed, or when its thread waits in a
collective but was woken again and again in between (it finished collectives and came back to
the same line: a healthy loop of all_reduce). A busy rank that keeps the same call chain is
stuck; one that calls other functions is slow.

A hang is only called when nothing moved. The verdicts are a table (hang_rules.RULES: one row
per kind with its priority and advice); each kind's evidence is its judge here (`@judges`),
and `decide` returns the first row, by priority, whose judge finds its evidence.

A thread that sits idle inside autograd's backward, with no Python hook on top, waits in a
collective torch issued from C++ (DDP's reducer all-reduces gradient buckets, FSDP's hooks
reduce-scatter them): its Python stack shows no collective, yet it is in one (`backward`).
The same for DDP's calls into its reducer and c10d in forward (`_FROM_CPP`). With --native
the C++ frames name it (c10d::, gloo::, nccl).

Where the doctor cannot tell which side is wrong (groups of equal size), it names no odd rank
and lists the `candidates` instead.

Where the ranks answered the doctor's channel (areal_cli.worker.channel), torch's flight
recorder adds what a stack cannot show: for each process group, each rank's last collective
number, op, sizes, dtypes and state (flight.py). Every verdict then says which collective
number each rank reached (`reached`), and a rank blocked in C++, whose stack shows no
collective, still gets its place from the collective it waits in.

Each verdict says how sure it is (`confidence`, `certainty`): one sample is a snapshot; several
samples in which nothing moved are evidence over that window, not beyond it.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from areal_cli.diagnose import collectives, hang_rules
from areal_cli.diagnose.flight import (
    Entry,
    RankFlight,
    groups_disagree,
    ops_disagree,
    sizes_disagree,
)
from areal_cli.diagnose.jsonfields import json_fields
from areal_cli.diagnose.stacks import Dump, Frame, ThreadStack

KINDS = hang_rules.KINDS
HANGS = hang_rules.HANGS

# A thread waiting in a collective that was scheduled in this often between samples (beyond
# what the dumps themselves cause) has been finishing collectives: one wake-up per completion.
WOKEN = 2

# C++ names seen with --native, matched when no Python-level frame names the collective.
_NATIVE = [
    (re.compile(r"allreduce|all_reduce", re.I), "all_reduce"),
    (re.compile(r"allgather|all_gather", re.I), "all_gather"),
    (re.compile(r"reduce_?scatter", re.I), "reduce_scatter"),
    (re.compile(r"broadcast", re.I), "broadcast"),
    (re.compile(r"barrier", re.I), "barrier"),
    (re.compile(r"alltoall|all_to_all", re.I), "all_to_all"),
    (re.compile(r"::(send|recv)\b", re.I), "send/recv"),
    (re.compile(r"Work::wait|wait_tensor"), "work.wait"),
    # DDP's reducer waiting for its bucket all-reduces at the end of backward.
    (re.compile(r"Reducer::(finalize_backward|mark_variable_ready|autograd_hook)"), "backward"),
]
_NATIVE_SCOPE = re.compile(r"c10d::|c10d_functional|gloo::|nccl", re.I)
_CUDA_SYNC = re.compile(r"cu(da)?(Stream|Device|Event|Ctx)Synchronize")
_WAIT_CALL = re.compile(r"\.wait\(\s*\)|\bwait_tensor\(")
_LIBRARY = re.compile(
    r"(site-packages|dist-packages)/|/lib/python3\.\d+/|/lib/pypy|^<frozen|/areal_cli/"
)


@dataclass
class RankSamples:
    """What was gathered for one rank: its dumps in sample order (a failed dump keeps its error)."""

    rank: int
    pid: int | None
    dumps: list[Dump] = field(default_factory=list)
    gone: bool = False  # the process is not there (never found, or exited)


@dataclass
class RankResult:
    rank: int
    pid: int | None
    state: str  # collective | busy | idle | missing | error
    collective: str | None = None  # normalized name ("all_reduce", "send/recv", ...)
    op: str | None = None  # the function it sits in ("all_gather_into_tensor", "wait")
    frame: Frame | None = None  # the user's own frame: file:line in their code
    thread: str | None = None
    stack: tuple[Frame, ...] = ()  # innermost first
    progress: str | None = None  # with several samples: "moving" | "still"; busy: "slow"/"stuck"
    # Times the thread was scheduled in between the first and the last sample, the dumps'
    # own doing not counted (None: one sample, or not known).
    wakeups: int | None = None
    error: str | None = None
    error_kind: str | None = None
    flight: RankFlight | None = None  # its flight recorder's dump, when it answered
    # Its threads that wait in a collective (last sample): with several, the order in which
    # they issued theirs may differ between ranks, which only the flight recorder shows.
    collective_threads: int = 0
    # Its collective is read from where torch issues one in C++ (_FROM_CPP), not named by a
    # frame: an inference, which the verdict's certainty says.
    inferred: bool = False

    @property
    def reached(self) -> Entry | None:
        return self.flight.reached() if self.flight else None

    @property
    def moved(self) -> bool:
        return self.progress in ("moving", "slow")

    def to_json(self) -> dict:
        return json_fields(self, "rank pid state collective op frame thread progress wakeups "
                                 "collective_threads error flight stack")  # fmt: skip


@dataclass
class Group:
    ranks: list[int]
    state: str
    collective: str | None
    frame: Frame | None
    stack: tuple[Frame, ...]

    def to_json(self) -> dict:
        return json_fields(self, "ranks state collective frame stack")


@dataclass
class Verdict:
    kind: str
    odd_ranks: list[int]
    missing_ranks: list[int]
    summary: str
    evidence: list[str] = field(default_factory=list)
    hint: str | None = None
    confidence: str = "low"  # "high": confirmed over several samples (or a rank is gone)
    certainty: str = ""  # how sure, in words
    # rank -> the collective it waits in (else its last one), from the flight recorder.
    reached: dict[int, Entry] = field(default_factory=dict)
    # Ranks that may be the odd ones where the evidence cannot tell (odd_ranks is then empty).
    candidates: list[int] = field(default_factory=list)
    advice: str = "unknown"  # restart | stop | unknown: the table's row for this kind
    advice_reason: str = ""

    @property
    def is_hang(self) -> bool:
        return self.kind in HANGS

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "hang": self.is_hang,
            "confidence": self.confidence,
            "certainty": self.certainty,
            "odd_ranks": self.odd_ranks,
            "candidates": self.candidates,
            "missing_ranks": self.missing_ranks,
            "advice": {"action": self.advice, "reason": self.advice_reason},
            "summary": self.summary,
            "evidence": self.evidence,
            "hint": self.hint,
            "reached": {str(r): e.to_json() for r, e in sorted(self.reached.items())},
        }


@dataclass
class Analysis:
    ranks: list[RankResult]
    groups: list[Group]
    verdict: Verdict | None  # None when no rank could be read at all

    def to_json(self) -> dict:
        return json_fields(self, "ranks groups verdict")


# --------------------------------------------------------------------------- frames


# Our example scripts (the GRPO example, the all_reduce repro) are the user's code wherever
# they are installed: a wheel puts them under site-packages/areal_cli/templates/, the
# checkout's install under src/areal_cli/templates/.
TEMPLATES = "/areal_cli/templates/"


def is_user_frame(f: Frame) -> bool:
    if f.native or f.file == "?":
        return False
    return TEMPLATES in f.file or not _LIBRARY.search(f.file)


def user_frame(frames: tuple[Frame, ...]) -> Frame | None:
    """The innermost frame in the user's own code (not torch, not the standard library)."""
    for f in frames:
        if is_user_frame(f):
            return f
    for f in frames:  # third-party code, at least not the interpreter's own
        if not f.native and not f.file.startswith("<"):
            return f
    return frames[0] if frames else None


def find_collective(frames: tuple[Frame, ...]) -> tuple[str, str] | None:
    """(collective, function) a stack waits in, or None.

    The outermost torch.distributed entry point wins: `all_gather_object` calls `all_gather`,
    `init_process_group` calls a barrier, and the user called the outer one.
    """
    for f in reversed(frames):
        if f.native:
            continue
        kind = collectives.lookup(f.file, f.function)
        if kind is not None:
            return kind, f.basename
    for f in frames:
        if f.native and _NATIVE_SCOPE.search(f.function):
            for pattern, name in _NATIVE:
                if pattern.search(f.function):
                    return name, f.function.split("(")[0]
    for f in frames:
        if f.native and _CUDA_SYNC.search(f.function):
            return "cuda_sync", f.function.split("(")[0]
    inner = next((f for f in frames if not f.native), None)
    if inner is not None:
        # Blocked in C called straight from user code: the source line says on what.
        if is_user_frame(inner) and inner.code and _WAIT_CALL.search(inner.code):
            return "work.wait", "wait"
        if inner.basename == "synchronize" and "torch/cuda" in inner.file:
            return "cuda_sync", "synchronize"
    return None


# Python frames from which torch issues a collective in C++, so that no frame above names it:
# (file, function, code of the line or None, collective). Autograd's engine running backward
# (DDP's reducer all-reduces gradient buckets, FSDP's hooks reduce-scatter them), and DDP's
# own calls into its reducer (the rebuilt bucket order, broadcast from rank 0 on the second
# forward) and into c10d (buffers and parameters broadcast, their shapes checked).
_FROM_CPP = (
    ("torch/autograd/graph.py", "_engine_run_backward", None, "backward"),
    ("torch/autograd/__init__.py", "backward", None, "backward"),
    ("torch/autograd/__init__.py", "grad", None, "backward"),
    ("torch/nn/parallel/distributed.py", None, re.compile(r"_rebuild_buckets\("), "broadcast"),
    ("torch/nn/parallel/distributed.py", None, re.compile(r"_broadcast_coalesced\("), "broadcast"),
    ("torch/distributed/utils.py", None, re.compile(r"_broadcast_coalesced\("), "broadcast"),
    ("torch/distributed/utils.py", None, re.compile(r"_verify_params_across_processes\("),
     "all_gather"),
)  # fmt: skip


def from_cpp(frames: tuple[Frame, ...]) -> tuple[str, str] | None:
    """(collective, function) when the innermost Python frame is one from which torch issues a
    collective in C++: idle there, the thread waits in it though its stack names none."""
    inner = next((f for f in frames if not f.native), None)
    if inner is None:
        return None
    for path, fn, code, coll in _FROM_CPP:
        if not inner.file.endswith(path) or (fn is not None and inner.function != fn):
            continue
        if code is None or (inner.code and code.search(inner.code)):
            return coll, inner.basename
    return None


def thread_collective(t: ThreadStack) -> tuple[str, str] | None:
    """(collective, function) a thread waits in: by its frames, or idle where torch issues one
    from C++."""
    found = find_collective(t.frames)
    if found is None and not t.active:
        return from_cpp(t.frames)
    return found


def thread_of_interest(threads: list[ThreadStack], pid: int | None) -> ThreadStack | None:
    main = None
    for t in threads:
        if pid is not None and t.os_thread_id == pid:
            main = t
    if main is None:
        main = next((t for t in threads if t.name == "MainThread"), threads[0] if threads else None)
    if main is not None and thread_collective(main) is None:
        for t in threads:
            if t is not main and t.frames and thread_collective(t) is not None:
                return t
    return main


def _signature(frames: tuple[Frame, ...], lines: bool = True) -> tuple:
    if lines:
        return tuple((f.file, f.function, f.line) for f in frames)
    return tuple((f.file, f.function) for f in frames)


# --------------------------------------------------------------------------- per rank


def classify_rank(rs: RankSamples) -> RankResult:
    good = [d for d in rs.dumps if d.ok]
    if rs.gone or (rs.dumps and rs.dumps[-1].error_kind == "gone"):
        why = "the process exited during the dump" if good else "the process is gone"
        return RankResult(rs.rank, rs.pid, "missing", error=why, error_kind="gone")
    stopped = bool(rs.dumps) and rs.dumps[-1].stopped
    if not good:
        last = rs.dumps[-1] if rs.dumps else None
        if stopped:
            return RankResult(rs.rank, rs.pid, "stopped", progress="still")
        return RankResult(
            rs.rank,
            rs.pid,
            "error",
            error=last.error if last else "not dumped",
            error_kind=last.error_kind if last else None,
        )
    picks = [thread_of_interest(d.threads, rs.pid) for d in good]
    picks = [t for t in picks if t is not None]
    if not picks:
        return RankResult(rs.rank, rs.pid, "error", error="no Python thread found")
    last = picks[-1]
    active_votes = sum(1 for t in picks if t.active)
    busy = active_votes * 2 >= len(picks) and active_votes > 0
    coll = find_collective(last.frames)
    inferred = coll is None and not busy and (coll := from_cpp(last.frames)) is not None
    if stopped:
        state = "stopped"
    elif coll is not None:
        state = "collective"
    elif busy:
        state = "busy"
    else:
        state = "idle"
    progress = None
    wakeups = _wakeups(good[1:], last.os_thread_id) if len(picks) > 1 else None
    if len(picks) > 1:
        moved = len({_signature(t.frames) for t in picks}) > 1
        if state == "collective" and wakeups is not None and wakeups >= WOKEN:
            moved = True  # back at the same line, but it finished collectives in between
        if state == "busy":
            # Spinning in one place keeps the same call chain (only lines move); a slow rank
            # that works through its step calls different functions from sample to sample.
            same_chain = len({_signature(t.frames, lines=False) for t in picks}) == 1
            progress = "stuck" if same_chain else "slow"
        else:
            progress = "moving" if moved else "still"
    if stopped:
        progress = "still"  # whatever it did before, it does nothing now
    return RankResult(
        rank=rs.rank,
        pid=rs.pid,
        state=state,
        collective=coll[0] if coll else None,
        op=coll[1] if coll else None,
        frame=user_frame(last.frames),
        thread=last.name,
        stack=last.frames,
        progress=progress,
        wakeups=wakeups,
        collective_threads=sum(1 for t in good[-1].threads if thread_collective(t) is not None),
        inferred=inferred,
    )


def _wakeups(later: list[Dump], tid: int | None) -> int | None:
    known = [d.ran[tid] for d in later if tid is not None and d.ran and tid in d.ran]
    return sum(known) if known else None


# --------------------------------------------------------------------------- verdict


def analyze(
    ranks: list[RankSamples],
    expected_ranks: list[int] | None = None,
    multi_host: bool = False,
    flights: dict[int, RankFlight] | None = None,
) -> Analysis:
    """`flights`: rank -> its flight recorder's dump, for the ranks that gave one."""
    results = [classify_rank(r) for r in ranks]
    for r in results:
        if flights and r.rank in flights:
            place_by_flight(r, flights[r.rank])
    known = {r.rank for r in results}
    for missing in sorted(set(expected_ranks or ()) - known):
        results.append(RankResult(missing, None, "missing", error="no process for this rank"))
    results.sort(key=lambda r: r.rank)
    groups = group_ranks(results)
    samples = max((len(r.dumps) for r in ranks), default=1)
    spans = [
        good[-1].taken_at - good[0].taken_at
        for r in ranks
        if len(good := [d for d in r.dumps if d.ok]) > 1
    ]
    window = min(spans) if spans else 0.0
    verdict = decide(results, groups, samples, multi_host)
    if verdict is not None:
        verdict.confidence, verdict.certainty = how_sure(verdict, results, samples, window)
        verdict.reached = {r.rank: r.reached for r in results if r.reached is not None}
    return Analysis(results, groups, verdict)


def place_by_flight(r: RankResult, f: RankFlight) -> None:
    """Attach the rank's flight recorder; a rank whose stack names no collective (blocked in
    C++ where py-spy sees native frames only, or unreadable) but which waits in one by its
    recorder is placed in that one."""
    r.flight = f
    waits = f.pending()
    if waits is None or r.state not in ("idle", "error"):
        return
    r.state = "collective"
    r.collective = collectives.kind_of(waits.op) or waits.op
    r.op = waits.op
    r.error = r.error_kind = None


def group_ranks(results: list[RankResult]) -> list[Group]:
    """Equivalence classes of identical stacks, biggest first."""
    buckets: dict[tuple, list[RankResult]] = {}
    for r in results:
        if r.state in ("missing", "error"):
            continue
        buckets.setdefault((r.state, _signature(r.stack)), []).append(r)
    groups = [
        Group(
            ranks=[r.rank for r in members],
            state=members[0].state,
            collective=members[0].collective,
            frame=members[0].frame,
            stack=members[0].stack,
        )
        for members in buckets.values()
    ]
    groups.sort(key=lambda g: (-len(g.ranks), g.ranks[0]))
    return groups


@dataclass
class Facts:
    """What the judges look at: the ranks by state, and whether anything moved."""

    results: list[RankResult]
    groups: list[Group]
    samples: int
    multi_host: bool
    present: list[RankResult] = field(init=False)
    missing: list[int] = field(init=False)
    waiting: list[RankResult] = field(init=False)
    busy: list[RankResult] = field(init=False)
    idle: list[RankResult] = field(init=False)
    stopped: list[RankResult] = field(init=False)
    moving: list[RankResult] = field(init=False)

    def __post_init__(self) -> None:
        self.present = [r for r in self.results if r.state not in ("missing", "error")]
        self.missing = [r.rank for r in self.results if r.state == "missing"]
        by_state: dict[str, list[RankResult]] = {}
        for r in self.present:
            by_state.setdefault(r.state, []).append(r)
        self.waiting = by_state.get("collective", [])
        self.busy = by_state.get("busy", [])
        self.idle = by_state.get("idle", [])
        self.stopped = by_state.get("stopped", [])
        self.moving = [r for r in self.present if r.moved] if self.samples > 1 else []

    @property
    def all_moved(self) -> bool:
        return bool(self.moving) and len(self.moving) == len(self.present)


Judge = Callable[[Facts], "Verdict | None"]
JUDGES: dict[str, Judge] = {}


def judges(kind: str) -> Callable[[Judge], Judge]:
    """Register the evidence for a row of hang_rules.RULES."""

    def register(fn: Judge) -> Judge:
        JUDGES[kind] = fn
        return fn

    return register


def decide(
    results: list[RankResult], groups: list[Group], samples: int = 1, multi_host: bool = False
) -> Verdict | None:
    """The first row of the table, by priority, whose judge finds its evidence."""
    f = Facts(results, groups, samples, multi_host)
    if not f.present:
        return None
    for rule in hang_rules.BY_PRIORITY:
        if rule.needs_still and f.all_moved:
            continue
        v = JUDGES[rule.kind](f)
        if v is not None:
            v.kind, v.advice, v.advice_reason = rule.kind, rule.advice, rule.why
            return v
    raise AssertionError("blocked_outside_collective matches whatever is left")


@judges("missing_rank")
def _missing(f: Facts) -> Verdict | None:
    if not f.missing:
        return None
    m = f.missing
    return Verdict(
        "missing_rank",
        m,
        m,
        f"{_ranks_word(m)} {'is' if len(m) == 1 else 'are'} gone (no live process) while "
        f"{_where_many(f.waiting or f.idle or f.busy)}",
        evidence=[f"rank {x}: no process" for x in m] + [_line(r) for r in f.present],
        hint="read the missing rank's log for its exit (`areal logs E/T`, or torchrun's "
        "output): it died or returned early, and the others wait for it forever",
    )


@judges("stopped_rank")
def _stopped(f: Facts) -> Verdict | None:
    if not f.stopped:
        return None
    stopped = f.stopped
    others = [r for r in f.present if r.state != "stopped"]
    pids = " ".join(str(r.pid) for r in stopped if r.pid)
    one = len(stopped) == 1
    return Verdict(
        "stopped_rank",
        [r.rank for r in stopped],
        [],
        f"{_ranks_word([r.rank for r in stopped])} (pid {pids.replace(' ', ', ')}) "
        f"{'is' if one else 'are'} stopped (state T: a SIGSTOP, Ctrl-Z or a job suspend), at "
        f"{_where(stopped[0])}" + (f", while {_where_many(others)}" if others else ""),
        evidence=[_line(r) for r in stopped + others],
        hint=f"`kill -CONT {pids}` resumes {'it' if one else 'them'}; find who stopped it (a "
        "terminal's Ctrl-Z, a debugger, a scheduler's suspend)",
    )


@judges("progressing")
def _progressing(f: Facts) -> Verdict | None:
    still = [r for r in f.present if not r.moved]
    if not f.moving or f.all_moved or not any(r.state in ("collective", "idle") for r in still):
        return None
    # Ranks standing in a collective wait for the ones that move: name those.
    named = all(r.state == "collective" for r in still) and not any(
        r.state == "collective" for r in f.moving
    )
    odd = [r.rank for r in f.moving] if named else []
    return Verdict(
        "progressing",
        odd,
        [],
        f"{_ranks_word([r.rank for r in f.moving])} moved across {f.samples} samples while "
        f"{_where_many(still)}: slow, not stuck (yet)",
        evidence=[_line(r) for r in f.moving + still],
        hint=(
            f"the others wait for {_ranks_word(odd)}: look at what "
            f"{'it does' if len(odd) == 1 else 'they do'} at {_where(f.moving[0])}; "
            "run the doctor again if this does not change"
            if odd
            else "run the doctor again, or with more --samples, if this does not change"
        ),
    )


@judges("straggler")
def _straggler(f: Facts) -> Verdict | None:
    if not (f.waiting and f.busy):
        return None
    busy = [r.rank for r in f.busy]
    if f.samples > 1:
        detail = (
            f"; {_ranks_word(busy)} did not leave {'its' if len(busy) == 1 else 'their'} loop "
            f"across {f.samples} samples (stuck)"
        )
    else:
        detail = "; pass --samples 3 to tell a stuck rank from a slow one"
    return Verdict(
        "straggler",
        busy,
        [],
        f"{_ranks_word(busy)} still computing at {_where(f.busy[0])} while "
        f"{_where_many(f.waiting)}{detail}",
        evidence=[_line(r) for r in f.busy + f.waiting],
        hint="look at what the busy rank does at that line: data-dependent work (uneven batch, "
        "a rank-0-only eval or checkpoint) makes the others wait",
    )


@judges("collective_type_mismatch")
def _type_mismatch(f: Facts) -> Verdict | None:
    kinds = Counter(r.collective for r in f.waiting)
    if len(kinds) < 2:
        return _ops_differ(f)
    first = {k: min(r.rank for r in f.waiting if r.collective == k) for k in kinds}
    order = sorted(kinds, key=lambda k: (-kinds[k], first[k]))
    tie = kinds[order[0]] == kinds[order[1]]
    # The biggest group is taken as the rest of the job. Groups of equal size give no such
    # hint: every rank of the tied groups is a candidate, none is named.
    main = order[0]
    outside = sorted([r.rank for r in f.waiting if r.collective != main] + [r.rank for r in f.idle])
    by_kind = "; ".join(
        f"{_ranks_word([r.rank for r in f.waiting if r.collective == k])} in {k} at "
        f"{_where(next(r for r in f.waiting if r.collective == k))}"
        for k in order
    )
    return Verdict(
        "collective_type_mismatch",
        [] if tie else outside,
        [],
        f"ranks wait in different collectives: {by_kind}"
        + (" (groups of equal size: either side may have taken the wrong branch)" if tie else ""),
        evidence=[_line(r) for r in f.waiting + f.idle],
        hint="every rank must call the same collectives in the same order; look for "
        "rank-dependent branches before these lines",
        candidates=sorted(r.rank for r in f.waiting + f.idle) if tie else [],
    )


def _ops_differ(f: Facts) -> Verdict | None:
    """The stacks agree, the flight recorder does not: one collective number of one group is a
    different op on different ranks (threads issuing in a rank-dependent order)."""
    found = ops_disagree(fl) if (fl := _flights(f)) else None
    if found is None:
        return None
    first, per_rank = found
    by_op: dict[str, list[int]] = {}
    for rank, e in sorted(per_rank.items()):
        by_op.setdefault(e.op, []).append(rank)
    _main, odd, cand = _majority(by_op, lambda k: by_op[k])
    ops = "; ".join(f"{_ranks_word(rs)} {op}" for op, rs in by_op.items())
    return Verdict(
        "collective_type_mismatch",
        odd,
        [],
        f"collective #{first.seq} of group {first.desc or first.pg} is a different op on "
        f"different ranks: {ops} (the stacks look alike: threads of a rank issue collectives "
        "in a rank-dependent order)",
        evidence=[_line(r) for r in f.present],
        hint="c10d numbers a group's collectives in the order they are issued: issue them from "
        "one thread, or give each thread a process group of its own"
        + (f"; look at the order on {_ranks_word(odd)}" if odd else ""),
        candidates=cand,
    )


@judges("mismatched_collective")
def _never_joined(f: Facts) -> Verdict | None:
    if not (f.waiting and f.idle):
        return None
    idle = [r.rank for r in f.idle]
    coll = f.waiting[0].collective
    return Verdict(
        "mismatched_collective",
        idle,
        [],
        f"{_where_many(f.waiting)}, but {_ranks_word(idle)} never joined: "
        f"{'it is' if len(idle) == 1 else 'they are'} at {_where(f.idle[0])}",
        evidence=[_line(r) for r in f.waiting + f.idle],
        hint=f"find why {_ranks_word(idle)} skipped the {coll}: a rank-dependent branch, an "
        "early return, or an exception caught and ignored",
    )


@judges("p2p_cycle")
def _p2p_cycle(f: Facts) -> Verdict | None:
    # With ranks on other hosts, the peer may be one of those: not a cycle among these.
    if f.multi_host or not f.waiting or len(f.waiting) != len(f.present):
        return None
    if any(r.collective != "send/recv" for r in f.waiting):
        return None
    return Verdict(
        "p2p_cycle",
        [],
        [],
        f"every rank waits in a point-to-point send/recv: {_where_many(f.waiting)}; each "
        "waits for a peer that itself waits",
        evidence=[_line(r) for r in f.waiting],
        hint="pair every recv with a send the peer issues first: order them by rank parity "
        "(even ranks send first), or post both at once with dist.batch_isend_irecv",
        candidates=sorted(r.rank for r in f.waiting),
    )


@judges("collective_stuck")
def _stuck(f: Facts) -> Verdict | None:
    if not f.waiting:
        return None
    sites = {(r.frame.file, r.frame.line) if r.frame else None for r in f.waiting}
    extra = (
        "; call sites differ, so the calls may not pair up (different process groups, shapes "
        "or order)"
        if len(sites) > 1
        else ""
    )
    threads = [r.rank for r in f.waiting if r.collective_threads > 1]
    if threads and not any(r.flight for r in f.waiting):
        extra += (
            f"; {_ranks_word(threads)} {'has' if len(threads) == 1 else 'have'} several threads "
            "in collectives, whose order may differ between ranks: the stacks cannot tell, the "
            "flight recorder can (run the job on areal's worker runtime)"
        )
    if f.multi_host:
        hint = "ranks on other hosts were not inspected: run `areal doctor hang` there too"
    else:
        hint = (
            "the collective itself does not complete: check the transport with "
            "`areal doctor env --preset nccl-bisect` and `areal doctor allreduce`"
        )
    w = f.waiting[0]
    return Verdict(
        "collective_stuck",
        [],
        [],
        f"every rank here waits in {w.collective} ({_where(w)}){extra}",
        evidence=[_line(r) for r in f.waiting],
        hint=hint,
    )


@judges("no_hang")
def _no_hang(f: Facts) -> Verdict | None:
    if f.all_moved:
        return Verdict(
            "no_hang",
            [],
            [],
            f"every rank moved across {f.samples} samples: the job is making progress",
            evidence=[_line(r) for r in f.present],
        )
    if f.waiting or not f.busy:
        return None
    text = f"no rank waits in a collective; {_ranks_word([r.rank for r in f.busy])} computing"
    if f.idle:
        text += f", {_ranks_word([r.rank for r in f.idle])} idle at {_where(f.idle[0])}"
    stuck = [r.rank for r in f.busy if r.progress == "stuck"] if f.samples > 1 else []
    if stuck:
        text += f"; {_ranks_word(stuck)} stayed in the same loop across {f.samples} samples"
    return Verdict("no_hang", [], [], text, evidence=[_line(r) for r in f.present])


@judges("blocked_outside_collective")
def _blocked(f: Facts) -> Verdict | None:
    live = [g for g in f.groups if g.state == "idle"]
    odd = sorted(r for g in live[1:] for r in g.ranks) if len(live) > 1 else []
    return Verdict(
        "blocked_outside_collective",
        odd,
        [],
        f"no rank is in a collective; {_where_many(f.idle, verb='blocked')}",
        evidence=[_line(r) for r in f.idle],
        hint="the wait is in your own code or a library: a queue nobody fills, a lock, a data "
        "loader or a server call; the frames above say which",
    )


def _majority(by: dict, ranks_of) -> tuple[object | None, list[int], list[int]]:
    """(the key most ranks share, the ranks of every other key, candidates): with keys of
    equal size there is no majority to go by, so nobody is named and every rank of the tied
    keys is a candidate."""
    sizes = sorted((len(ranks_of(k)) for k in by), reverse=True)
    if len(sizes) > 1 and sizes[0] == sizes[1]:
        tied = sorted(r for k in by if len(ranks_of(k)) == sizes[0] for r in ranks_of(k))
        return None, [], tied
    main = max(by, key=lambda k: len(ranks_of(k)))
    return main, sorted(r for k in by if k != main for r in ranks_of(k)), []


def _flights(f: Facts) -> list[RankFlight]:
    fl = [r.flight for r in f.present if r.flight is not None and r.flight.ok]
    return fl if len(fl) > 1 else []


@judges("shape_mismatch")
def _shape_mismatch(f: Facts) -> Verdict | None:
    found = sizes_disagree(fl) if (fl := _flights(f)) else None
    if found is None:
        return None
    by_rank = {r.rank: r for r in f.present}
    first, per_rank = found
    by_size: dict[tuple, list[int]] = {}
    for rank, e in sorted(per_rank.items()):
        by_size.setdefault(e.input_sizes, []).append(rank)
    _main, odd, cand = _majority(by_size, lambda k: by_size[k])
    if not odd:
        # Camps of equal size: the sizes say which ranks differ, not which is wrong. The camp
        # of the lowest rank is taken as the reference, and every rank stays a candidate.
        ref = by_size[next(iter(by_size))]
        odd = sorted(r for rs in by_size.values() if rs is not ref for r in rs)
    sizes = "; ".join(
        f"{_ranks_word(rs)} {_sizes(k)} {','.join(per_rank[rs[0]].dtypes)}"
        for k, rs in by_size.items()
    )
    waiting_in = sorted(r for r, e in per_rank.items() if e.pending)
    gone_on = sorted(r for r, e in per_rank.items() if not e.pending)
    tail = f"; {_ranks_word(waiting_in)} still {'waits' if len(waiting_in) == 1 else 'wait'} in it"
    if gone_on:
        tail += f", {_ranks_word(gone_on)} returned from it (with wrong data) and went on to " + ", ".join(
            f"#{by_rank[r].reached.seq}" for r in gone_on if by_rank.get(r) and by_rank[r].reached
        )  # fmt: skip
    where = next((by_rank[r] for r in odd if r in by_rank), None)
    return Verdict(
        "shape_mismatch",
        odd,
        [],
        f"collective #{first.seq} of group {first.desc or first.pg} ({first.op}) got different "
        f"sizes: {sizes}{tail}",
        evidence=[_line(r) for r in f.present],
        hint="every rank must give a collective tensors of the same shape and dtype: look at how "
        f"the tensor is sized on {_ranks_word(odd)}"
        + (f" before {_where(where)}" if where else "")
        + " (uneven batches, a rank-dependent padding or model part)",
        candidates=cand,
    )


@judges("wrong_group")
def _wrong_group(f: Facts) -> Verdict | None:
    by_group = groups_disagree(fl) if (fl := _flights(f)) else None
    if by_group is None:
        return None
    by_rank = {r.rank: r for r in f.present}
    # A group whose every member waits in its pending collective is consistent: its members
    # called it together. The ranks in the other groups are the odd ones.
    members = {pg: next((m for x in fl if (m := x.members(pg))), None) for pg in by_group}
    whole = [pg for pg, rs in by_group.items() if members[pg] and set(members[pg]) <= set(rs)]
    if len(whole) == 1:
        odd, cand = sorted(r for pg, rs in by_group.items() if pg != whole[0] for r in rs), []
    else:
        _main, odd, cand = _majority(by_group, lambda k: by_group[k])
    desc = {e.pg: e.desc or e.pg for x in fl if (e := x.pending()) is not None}
    parts = "; ".join(
        f"{_ranks_word(rs)} in group {desc[pg]} (#{by_rank[rs[0]].reached.seq} "
        f"{by_rank[rs[0]].reached.op})"
        for pg, rs in by_group.items()
    )
    look = odd or cand
    return Verdict(
        "wrong_group",
        odd,
        [],
        f"ranks wait in collectives of different process groups: {parts}; each group waits for "
        "members that sit in the other" + ("" if odd else " (either side may be the wrong one)"),
        evidence=[_line(r) for r in f.present],
        hint="every member of a group must call its collectives with that same group: look for "
        f"the group {_ranks_word(look)} chose (a dp/tp mix-up, a group picked by rank, an order "
        "that differs per rank) before "
        + (_where(by_rank[look[0]]) if look and look[0] in by_rank else "the collective"),
        candidates=cand,
    )


def _sizes(k: tuple) -> str:
    return "[" + ", ".join("x".join(map(str, s)) or "scalar" for s in k) + "]"


def how_sure(v: Verdict, results: list[RankResult], samples: int, window: float) -> tuple[str, str]:
    """("high" | "low", why): what the samples prove about this verdict."""
    over = f"{samples} samples over {window:.1f}s"
    if v.kind == "missing_rank":
        return "high", "a rank's process is gone; the others cannot finish without it"
    if v.kind == "stopped_rank":
        return "high", "the kernel says the process is stopped; it cannot run until continued"
    if samples < 2:
        if v.is_hang:
            return "low", (
                "one sample: a snapshot, not proof; a healthy job caught inside a collective "
                "looks the same (use --samples 3 or more)"
            )
        return "low", "one sample: nothing waits at this moment"
    if not v.is_hang:
        if v.kind == "no_hang" and not any(r.moved for r in results):
            return "low", f"nobody waits, but no stack changed across {over}"
        return "high", f"stacks changed (or waits ended) across {over}: the job moved"
    asleep = [r.rank for r in results if r.wakeups == 0]
    slept = f"; {_ranks_word(asleep)} did not even run" if asleep else ""
    return "high", (
        f"nothing moved across {over}{slept}; a step or collective slower than "
        f"{window:.1f}s looks the same (raise --samples or --interval to wait longer)"
        + _inferred(results)
    )


def _inferred(results: list[RankResult]) -> str:
    ranks = [r.rank for r in results if r.inferred]
    if not ranks:
        return ""
    return (
        f"; {_ranks_word(ranks)} {'waits' if len(ranks) == 1 else 'wait'} where torch issues a "
        "collective from C++ (no Python frame names it): read from that call site, which "
        "--native confirms"
    )


# --------------------------------------------------------------------------- wording


def _ranks_word(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + _compress(ranks)


def _compress(ranks: list[int]) -> str:
    """[0,1,2,5] -> "0-2,5"."""
    out, start, prev = [], None, None
    for r in ranks:
        if start is None:
            start = prev = r
        elif r == prev + 1:
            prev = r
        else:
            out.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = prev = r
    if start is not None:
        out.append(f"{start}-{prev}" if prev > start else f"{start}")
    return ",".join(out)


def _where(r: RankResult) -> str:
    if r.frame is None:
        return "an unknown place"
    return f"{r.frame.where()} in {r.frame.function}"


def _where_many(rs: list[RankResult], verb: str | None = None) -> str:
    if not rs:
        return "nothing else runs"
    by_place: dict[str, list[int]] = {}
    for r in rs:
        what = verb or ("wait in " + r.collective if r.collective else r.state)
        key = f"{what} at {_where(r)}"
        by_place.setdefault(key, []).append(r.rank)
    parts = []
    for key, ranks in by_place.items():
        verb_word = key
        if len(ranks) == 1 and key.startswith("wait "):
            verb_word = "waits " + key[5:]
        parts.append(f"{_ranks_word(ranks)} {verb_word}")
    return "; ".join(parts)


def _line(r: RankResult) -> str:
    what = {
        "collective": (
            "waits in a collective torch issued inside backward (DDP's reducer, FSDP's hooks; "
            "its Python stack shows none)"
            if r.collective == "backward"
            else f"waits in {r.collective}"
            + (f" ({r.op})" if r.op and r.op != r.collective else "")
        ),
        "busy": "computing",
        "idle": "idle",
        "stopped": "stopped",
    }.get(r.state, r.state)
    where = _where(r)
    pid = f" (pid {r.pid})" if r.pid else ""
    prog = f" [{r.progress}]" if r.progress else ""
    reached = f"; {r.reached.label()}" if r.reached is not None else ""
    return f"rank {r.rank}{pid}: {what} at {where}{prog}{reached}"
