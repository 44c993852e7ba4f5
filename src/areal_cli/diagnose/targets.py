"""Which processes are the ranks of a job: from pids (a launcher expands to its workers), from
a job record, or every torchrun/areal job of this user on this host.

A rank is the topmost Python process carrying `RANK` in its environment: torchrun's workers.
Their own children (DataLoader workers, compile workers) inherit `RANK` and are skipped.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from areal_cli import jobs, procs, settings
from areal_cli.errors import UsageError

RANK_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    procs.MARKER_ENV,
)

_PYTHON_EXE = re.compile(r"^(python|pypy)[0-9.]*$")


@dataclass
class RankProc:
    pid: int
    rank: int | None
    local_rank: int | None
    world_size: int | None
    local_world_size: int | None
    cmdline: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def job_key(self) -> tuple:
        e = self.env
        return (e.get("MASTER_ADDR"), e.get("MASTER_PORT"), e.get("TORCHELASTIC_RUN_ID"))


@dataclass
class Job:
    label: str  # "torchrun pid 123 (train.py)", "job exp/trial0", "pids 1,2"
    ranks: list[RankProc]
    launcher_pid: int | None = None
    name: str | None = None  # experiment/trial for --job

    @property
    def world_size(self) -> int:
        sizes = [r.world_size for r in self.ranks if r.world_size]
        return max(sizes) if sizes else len(self.ranks)

    def expected_local_ranks(self) -> list[int]:
        """Ranks that should run on this host: all of them on one node, this node's block of
        LOCAL_WORLD_SIZE ranks on several."""
        ws = self.world_size
        lws = max((r.local_world_size or 0 for r in self.ranks), default=0)
        if not lws or lws >= ws:
            return list(range(ws))
        bases = {
            r.rank - r.local_rank
            for r in self.ranks
            if r.rank is not None and r.local_rank is not None
        }
        expected: set[int] = set()
        for base in bases:
            expected.update(range(base, min(base + lws, ws)))
        return sorted(expected) if expected else [r.rank for r in self.ranks if r.rank is not None]

    @property
    def multi_host(self) -> bool:
        return len(self.expected_local_ranks()) < self.world_size

    def to_json(self) -> dict:
        return {
            "label": self.label,
            "name": self.name,
            "launcher_pid": self.launcher_pid,
            "world_size": self.world_size,
            "local_ranks_expected": self.expected_local_ranks(),
            "multi_host": self.multi_host,
            "host": settings.hostname(),
        }


# --------------------------------------------------------------------------- resolution


def resolve(
    pids: list[int] | None = None, job: str | None = None, home: str | Path | None = None
) -> list[Job]:
    """Turn what the user named into jobs with their rank processes; UsageError (exit 2) when
    a target does not exist, is not Python, or holds no ranks."""
    if job:
        return [_from_job(job, home)]
    if pids:
        return _from_pids(pids)
    return _discover()


def _from_pids(pids: list[int]) -> list[Job]:
    groups: dict[tuple, Job] = {}
    for pid in dict.fromkeys(pids):
        proc = _process(pid)
        if is_launcher(proc):
            ranks = _ranks_under([proc])
            if not ranks:
                raise UsageError(
                    f"pid {pid} ({_describe(proc)}) is a launcher without live worker processes",
                    hint="the workers may have exited already, or not started yet; "
                    "`ps --forest -g $(ps -o sid= -p PID)` shows what runs under it",
                )
            key = ("launcher", pid)
            groups[key] = Job(label=launcher_label(proc), ranks=ranks, launcher_pid=pid)
            continue
        ranks = _ranks_under([proc])
        if ranks and ranks[0].pid != pid:
            # A parent of ranks that is not a known launcher (a custom spawner): take its ranks.
            key = ("parent", pid)
            groups[key] = Job(label=f"pid {pid} ({_describe(proc)})", ranks=ranks, launcher_pid=pid)
            continue
        if not is_python(proc):
            raise UsageError(
                f"pid {pid} ({_describe(proc)}) is not a Python process",
                hint="give the pid of a training rank or of its launcher (torchrun, areal train)",
            )
        rank = ranks[0] if ranks else _rank_proc(proc)
        if rank is None:
            raise UsageError(f"no process with pid {pid}", hint="it exited while being read")
        key = ("env", *rank.job_key()) if any(rank.job_key()) else ("pids",)
        if key not in groups:
            groups[key] = Job(label="", ranks=[])
        groups[key].ranks.append(rank)
    out = []
    for j in groups.values():
        if not j.label:
            pids_text = ",".join(str(r.pid) for r in j.ranks)
            j.label = f"pids {pids_text}"
        j.ranks = _number(j.ranks)
        out.append(j)
    return out


def _from_job(name: str, home: str | Path | None) -> Job:
    experiment, trial = jobs.parse_name(name)
    record = jobs.load(settings.home(home), experiment, trial)
    roots = [p for p in record.pids if procs.pid_alive(p)]
    candidates = procs.tree(roots)
    if record.marker:
        seen = {p.pid for p in candidates}
        for p in procs.find_marked(record.marker):
            if p.pid not in seen:
                candidates.append(p)
                seen.add(p.pid)
    ranks = _topmost_ranks(candidates)
    if not ranks:
        raise UsageError(
            f"job {record.name} has no live rank processes on this host (state: {record.state})",
            hint=f"`areal ps` shows its state; `areal logs {record.name}` shows why it ended",
        )
    return Job(
        label=f"job {record.name}",
        ranks=_number(ranks),
        launcher_pid=next((p.pid for p in record.processes if p.role == "trainer"), None),
        name=record.name,
    )


def _discover() -> list[Job]:
    """Every torchrun/areal job of this user on this host, plus orphaned ranks whose launcher
    died (grouped by their rendezvous address)."""
    me = os.getpid()
    mine = {me} | {p.pid for p in _parents(me)}
    uid = os.getuid()
    launchers: list[psutil.Process] = []
    pythons: list[psutil.Process] = []
    for p in psutil.process_iter(["pid", "uids", "cmdline", "name", "exe"]):
        try:
            if p.pid in mine or (p.info["uids"] and p.info["uids"].real != uid):
                continue
            if is_launcher(p):
                launchers.append(p)
            elif is_python(p):
                pythons.append(p)
        except psutil.Error:
            continue
    launcher_pids = {p.pid for p in launchers}
    top = [p for p in launchers if not any(a.pid in launcher_pids for a in _parents(p.pid))]
    found: list[Job] = []
    claimed: set[int] = set()
    for p in sorted(top, key=lambda q: q.pid):
        ranks = _ranks_under([p])
        if ranks:
            found.append(Job(label=launcher_label(p), ranks=_number(ranks), launcher_pid=p.pid))
            claimed.update(r.pid for r in ranks)
    orphans: dict[tuple, list[RankProc]] = {}
    python_pids = {q.pid for q in pythons}
    for p in pythons:
        if p.pid in claimed or any(a.pid in launcher_pids for a in _parents(p.pid)):
            continue
        r = _rank_proc(p)
        if r is None or "TORCHELASTIC_RUN_ID" not in r.env or r.rank is None:
            continue
        if any(a.pid in python_pids and _has_rank(a) for a in _parents(p.pid)):
            # A DataLoader worker of an orphaned rank: its parent is the rank.
            continue
        orphans.setdefault(r.job_key(), []).append(r)
    for key, ranks in orphans.items():
        found.append(
            Job(label=f"orphaned ranks (launcher gone, port {key[1]})", ranks=_number(ranks))
        )
    if not found:
        raise UsageError(
            f"no torchrun or areal job of user {settings.user()} runs on this host",
            hint="name one: areal doctor hang --pid PID (a rank or its torchrun) or --job E/T",
        )
    return found


# --------------------------------------------------------------------------- helpers


def is_launcher(p: psutil.Process) -> bool:
    cmd = _cmdline(p)
    if not cmd:
        return False
    joined = " ".join(cmd[:4])
    if "torch.distributed.run" in joined or "torch.distributed.launch" in joined:
        return True
    names = [os.path.basename(c) for c in cmd[:2]]
    if "torchrun" in names:
        return True
    # `areal train ...` / `python -m areal_cli ...`: a supervisor whose torchrun holds the ranks.
    if "areal" in names or "areal_cli" in joined or "areal_cli.cli" in joined:
        return True
    return False


def is_python(p: psutil.Process) -> bool:
    try:
        exe = p.exe()
    except (psutil.Error, OSError):
        exe = ""
    if exe and _PYTHON_EXE.match(os.path.basename(exe)):
        return True
    try:
        name = p.name()
    except psutil.Error:
        name = ""
    if _PYTHON_EXE.match(name):
        return True
    try:
        with open(f"/proc/{p.pid}/maps") as f:
            return any("libpython" in line for line in f)
    except OSError:
        return False


def launcher_label(p: psutil.Process) -> str:
    cmd = _cmdline(p)
    script = next((c for c in cmd[1:] if c.endswith(".py")), None)
    kind = (
        "torchrun" if "torch" in " ".join(cmd[:4]) or "torchrun" in " ".join(cmd[:2]) else "areal"
    )
    return f"{kind} pid {p.pid}" + (f" ({os.path.basename(script)})" if script else "")


def _process(pid: int) -> psutil.Process:
    if pid <= 0:
        raise UsageError(f"{pid} is not a process id", hint="pids are positive integers")
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            raise UsageError(
                f"pid {pid} has exited (zombie, waiting for its parent to reap it)",
                hint="nothing to dump: its launcher's log tells how it ended",
            )
        return p
    except psutil.NoSuchProcess:
        raise UsageError(
            f"no process with pid {pid}",
            hint="`ps -ef | grep torchrun` or `areal ps` lists what runs",
        ) from None
    except psutil.AccessDenied:
        raise UsageError(f"pid {pid} cannot be inspected by this user") from None


def _ranks_under(roots: list[psutil.Process]) -> list[RankProc]:
    return _topmost_ranks(procs.tree([r.pid for r in roots]))


def _topmost_ranks(candidates: list[psutil.Process]) -> list[RankProc]:
    with_rank: dict[int, RankProc] = {}
    for p in candidates:
        try:
            if p.status() == psutil.STATUS_ZOMBIE or not is_python(p):
                continue
        except psutil.Error:
            continue
        r = _rank_proc(p)
        if r is not None and r.rank is not None:
            with_rank[p.pid] = r
    out = []
    for pid, r in with_rank.items():
        parents = _parents(pid)
        if any(a.pid in with_rank for a in parents):
            continue  # a DataLoader/compile worker of a rank: it inherited RANK
        out.append(r)
    return sorted(out, key=lambda r: (r.rank if r.rank is not None else 1 << 30, r.pid))


def _rank_proc(p: psutil.Process) -> RankProc | None:
    try:
        env = p.environ()
        cmd = p.cmdline()
    except psutil.NoSuchProcess:
        return None
    except (psutil.AccessDenied, OSError):
        env, cmd = {}, []
    sub = {k: env[k] for k in RANK_ENV if k in env}
    return RankProc(
        pid=p.pid,
        rank=_int(sub.get("RANK")),
        local_rank=_int(sub.get("LOCAL_RANK")),
        world_size=_int(sub.get("WORLD_SIZE")),
        local_world_size=_int(sub.get("LOCAL_WORLD_SIZE")),
        cmdline=cmd,
        env=sub,
    )


def _has_rank(p: psutil.Process) -> bool:
    try:
        return "RANK" in p.environ()
    except (psutil.Error, OSError):
        return False


def _number(ranks: list[RankProc]) -> list[RankProc]:
    """Ranks without RANK (plain Python processes named by pid) get numbers after the others."""
    taken = {r.rank for r in ranks if r.rank is not None}
    nxt = 0
    for r in sorted(ranks, key=lambda r: r.pid):
        if r.rank is None:
            while nxt in taken:
                nxt += 1
            r.rank = nxt
            taken.add(nxt)
    return sorted(ranks, key=lambda r: (r.rank, r.pid))


def _parents(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).parents()
    except psutil.Error:
        return []


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except (psutil.Error, OSError):
        return []


def _describe(p: psutil.Process) -> str:
    cmd = _cmdline(p)
    text = " ".join(cmd) if cmd else p.name()
    return text if len(text) <= 60 else text[:57] + "..."


def _int(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None
