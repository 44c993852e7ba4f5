"""Which processes are the ranks of a job: from pids (a launcher expands to its workers), or
every torchrun/areal job of this user on this host (`resolve`); a job named by its record is
diagnose.job_ranks's, on the `Tree` of processes read here. A `Job` carries its own way to
reach its nodes when they are a cluster's (`reach`, handed in by whoever knows its scheduler).

A rank is the topmost Python process carrying `RANK` in its environment: torchrun's workers.
Their own children (DataLoader workers, compile workers) inherit `RANK` and are skipped.

Each process is read once (status, parent, environment): a job of 64 ranks is found in
milliseconds, and a process that exits meanwhile is skipped, or named as gone, never a
traceback.

Processes are read from /proc by `Proc` (the few psutil.Process methods used here), not by
psutil: `doctor hang` finds the ranks before its first dump starts, and psutil's import was
a fifth of that start-up.
"""

from __future__ import annotations

import errno
import os
import re

from areal_cli.errors import UsageError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from collections.abc import Callable

RANK_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "AREAL_JOB_MARKER",  # procs.MARKER_ENV (a test holds them equal): procs imports psutil
)

_PYTHON_EXE = re.compile(r"^(python|pypy)[0-9.]*$")


class ProcError(Exception):
    """A process could not be read (psutil.Error's place here)."""

    def __init__(self, pid: int, msg: str = "") -> None:
        super().__init__(msg or f"pid {pid}")
        self.pid = pid


class NoSuchProcess(ProcError):
    """The process does not exist (any more)."""


class AccessDenied(ProcError):
    """This user may not read that part of the process."""


ZOMBIE = "zombie"
_STATES = {"R": "running", "S": "sleeping", "D": "disk-sleep", "T": "stopped",
           "t": "tracing-stop", "Z": ZOMBIE, "X": "dead", "I": "idle"}  # fmt: skip


class Proc:
    """One process read from /proc, with the methods of psutil.Process this module uses."""

    __slots__ = ("pid",)

    def __init__(self, pid: int) -> None:
        self.pid = pid
        if not os.path.exists(f"/proc/{pid}/stat"):
            raise NoSuchProcess(pid, f"no process with pid {pid}")

    def _read(self, name: str) -> bytes:
        try:
            with open(f"/proc/{self.pid}/{name}", "rb") as f:
                return f.read()
        except OSError as e:
            raise self._error(e) from None

    def _error(self, e: OSError) -> ProcError:
        if e.errno in (errno.EACCES, errno.EPERM):
            return AccessDenied(self.pid, f"pid {self.pid}: {e.strerror}")
        return NoSuchProcess(self.pid, f"pid {self.pid} exited")

    def _stat(self) -> tuple[str, str]:
        """(comm, state letter)."""
        text = self._read("stat")
        start, end = text.find(b"("), text.rfind(b")")
        if start < 0 or end < 0:
            raise NoSuchProcess(self.pid)
        return text[start + 1 : end].decode(errors="replace"), text[end + 2 : end + 3].decode()

    def status(self) -> str:
        letter = self._stat()[1]
        return _STATES.get(letter, letter)

    def name(self) -> str:
        return self._stat()[0]

    def cmdline(self) -> list[str]:
        data = self._read("cmdline").decode(errors="replace")
        if not data:
            return []
        if "\0" not in data.rstrip("\0") and " " in data:
            return data.split()  # a process that rewrote its title (setproctitle), as psutil
        return data.rstrip("\0").split("\0")

    def environ(self) -> dict[str, str]:
        out = {}
        for kv in self._read("environ").decode(errors="replace").split("\0"):
            key, eq, value = kv.partition("=")
            if eq and key:
                out[key] = value
        return out

    def exe(self) -> str:
        try:
            return os.readlink(f"/proc/{self.pid}/exe")
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{self.pid}"):
                raise NoSuchProcess(self.pid) from None
            return ""  # a zombie or a kernel thread: no executable, as psutil says
        except OSError as e:
            raise self._error(e) from None

    def real_uid(self) -> int | None:
        for line in self._read("status").splitlines():
            if line.startswith(b"Uid:"):
                return int(line.split()[1])
        return None


class _Record:
    """Repr and equality over the fields named in `_fields`, as a dataclass has them.

    RankProc and Job are plain classes rather than dataclasses: `doctor hang` finds the ranks
    before its first py-spy starts, and dataclasses (with inspect, which it imports) was the
    largest import on that way.
    """

    _fields: tuple[str, ...] = ()

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={getattr(self, k)!r}" for k in self._fields)
        return f"{type(self).__name__}({inner})"

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return all(getattr(self, k) == getattr(other, k) for k in self._fields)

    __hash__ = None  # mutable, as a dataclass without frozen=True


class RankProc(_Record):
    _fields = ("pid", "rank", "local_rank", "world_size", "local_world_size", "cmdline", "env",
               "node")  # fmt: skip

    def __init__(
        self,
        pid: int,
        rank: int | None,
        local_rank: int | None,
        world_size: int | None,
        local_world_size: int | None,
        cmdline: list[str],
        env: dict[str, str] | None = None,
        node: str | None = None,  # a rank of a cluster job: the node it runs on
    ) -> None:
        self.pid, self.rank, self.local_rank = pid, rank, local_rank
        self.world_size, self.local_world_size = world_size, local_world_size
        self.cmdline = cmdline
        self.env = {} if env is None else env
        self.node = node

    def job_key(self) -> tuple:
        e = self.env
        return (e.get("MASTER_ADDR"), e.get("MASTER_PORT"), e.get("TORCHELASTIC_RUN_ID"))


class Job(_Record):
    # `reach` is neither shown nor compared.
    _fields = ("label", "ranks", "launcher_pid", "name", "scheduler_job_id", "nodes", "marker",
               "lead")  # fmt: skip

    def __init__(
        self,
        label: str,  # "torchrun pid 123 (train.py)", "job exp/trial0", "pids 1,2"
        ranks: list[RankProc],
        launcher_pid: int | None = None,
        name: str | None = None,  # experiment/trial for --job
        # A cluster job: its id, the nodes to reach, and where the marker finds its ranks.
        scheduler_job_id: str | None = None,
        nodes: dict[str, list[int]] | None = None,  # node -> rank pids (or none known)
        marker: str | None = None,
        # How to run a command on those nodes, handed in by whoever knows the job's scheduler
        # (its run_on_nodes): reach(job_id, {node: argv}, timeout) -> {node: (stdout, why)}.
        reach: Callable | None = None,
        lead: float = 0.5,  # seconds ahead for every node to start at one moment (node_start_s)
    ) -> None:
        self.label, self.ranks, self.launcher_pid, self.name = label, ranks, launcher_pid, name
        self.scheduler_job_id = scheduler_job_id
        self.nodes = {} if nodes is None else nodes
        self.marker, self.reach, self.lead = marker, reach, lead

    @property
    def on_other_nodes(self) -> bool:
        """Whether its ranks run on the nodes of a cluster job (read there, through `reach`)
        rather than on this host."""
        return bool(self.scheduler_job_id)

    def run_on_nodes(
        self, command: Callable[[str], list[str]], timeout: float
    ) -> dict[str, tuple[str | None, str | None]]:
        """node -> (stdout, why there is none) of command(node) run on every node at once."""
        if self.reach is None:
            raise UsageError(f"{self.label}: its scheduler gives no way to reach its nodes")
        got = self.reach(self.scheduler_job_id, {n: command(n) for n in self.nodes}, timeout)
        return {n: got.get(n, (None, f"node {n} was not reached")) for n in self.nodes}

    @property
    def world_size(self) -> int:
        sizes = [r.world_size for r in self.ranks if r.world_size]
        return max(sizes) if sizes else len(self.ranks)

    def expected_local_ranks(self) -> list[int]:
        """Ranks that should run on this host: all of them on one node, this node's block of
        LOCAL_WORLD_SIZE ranks on several; every rank of a cluster job (every node is read)."""
        ws = self.world_size
        if self.on_other_nodes:
            return list(range(ws))
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
            "host": _hostname(),
            **(
                {"scheduler_job_id": self.scheduler_job_id,
                 "nodes": {str(r.rank): r.node for r in self.ranks}}
                if self.on_other_nodes else {}
            ),
        }  # fmt: skip


# --------------------------------------------------------------------------- resolution


def resolve(pids: list[int] | None = None) -> list[Job]:
    """Turn the pids the user named (none: every job of this user here) into jobs with their
    rank processes; UsageError (exit 2) when a target does not exist (or exits while being
    read), is not Python, or holds no ranks. A job named by its record: `from_record`."""
    try:
        if pids:
            return _from_pids(pids)
        return _discover()
    except NoSuchProcess as e:
        raise exited(e) from None


def exited(e: NoSuchProcess) -> UsageError:
    return UsageError(
        f"pid {e.pid} exited while its ranks were being found",
        hint="the job is ending or restarting: `areal ps` or its launcher's log says which",
    )


def _from_pids(pids: list[int]) -> list[Job]:
    tree = Tree()
    groups: dict[tuple, Job] = {}
    for pid in dict.fromkeys(pids):
        proc = _process(pid)
        if is_launcher(proc):
            ranks = tree.ranks_under(pid)
            if not ranks:
                raise UsageError(
                    f"pid {pid} ({_describe(proc)}) is a launcher without live worker processes",
                    hint="the workers may have exited already, or not started yet; "
                    "`ps --forest -g $(ps -o sid= -p PID)` shows what runs under it",
                )
            key = ("launcher", pid)
            groups[key] = Job(label=launcher_label(proc), ranks=ranks, launcher_pid=pid)
            continue
        ranks = tree.ranks_under(pid)
        if ranks and ranks[0].pid != pid:
            if not _is_spawner(proc, ranks, tree):
                # init, a shell, a container runtime: every job below it is not one job.
                jobs = {r.job_key() for r in ranks}
                raise UsageError(
                    f"pid {pid} ({_describe(proc)}) is neither a launcher (torchrun, areal) "
                    f"nor a rank: {len(ranks)} rank process(es) of {len(jobs)} job(s) run "
                    "under it",
                    hint="name a job's torchrun or its ranks (--pid PID), or --job E/T; "
                    "`areal doctor hang` without a target finds every job of yours",
                )
            # A custom spawner (mp.spawn), a wrapper script or a container's init holding
            # one job: its ranks.
            key = ("parent", pid)
            groups[key] = Job(label=f"pid {pid} ({_describe(proc)})", ranks=ranks, launcher_pid=pid)
            continue
        if not is_python(proc):
            raise UsageError(
                f"pid {pid} ({_describe(proc)}) is not a Python process",
                hint="give the pid of a training rank or of its launcher (torchrun, areal train)",
            )
        rank = ranks[0] if ranks else rank_proc(proc)
        if rank is None:
            raise UsageError(f"pid {pid} exited while being read", hint="nothing left to dump")
        key = ("env", *rank.job_key()) if any(rank.job_key()) else ("pids",)
        if key not in groups:
            groups[key] = Job(label="", ranks=[])
        groups[key].ranks.append(rank)
    out = []
    for j in groups.values():
        if not j.label:
            pids_text = ",".join(str(r.pid) for r in j.ranks)
            j.label = f"pids {pids_text}"
        j.ranks = number(j.ranks)
        out.append(j)
    return out


def under(roots: list[int], label: str, name: str | None = None) -> Job | None:
    """The ranks below these processes (a launcher's torchrun), as one job; None when none
    runs (yet, or any more)."""
    tree = Tree()
    ranks = tree.topmost_ranks({pid for root in roots for pid in tree.descendants(root)})
    if not ranks:
        return None
    return Job(label=label, ranks=number(ranks), launcher_pid=roots[0] if roots else None,
               name=name)  # fmt: skip


def _discover() -> list[Job]:
    """Every torchrun/areal job of this user on this host, plus orphaned ranks whose launcher
    died (grouped by their rendezvous address)."""
    tree = Tree()
    mine = {os.getpid(), *tree.ancestors(os.getpid())}
    uid = os.getuid()
    launchers: list[Proc] = []
    pythons: list[Proc] = []
    for pid in sorted(tree.parent):
        if pid in mine:
            continue
        p = tree.proc(pid)
        try:
            if p is None or p.real_uid() != uid:
                continue
            if is_launcher(p):
                launchers.append(p)
            elif is_python(p):
                pythons.append(p)
        except ProcError:
            continue
    launcher_pids = {p.pid for p in launchers}
    top = [p for p in launchers if not launcher_pids.intersection(tree.ancestors(p.pid))]
    found: list[Job] = []
    claimed: set[int] = set()
    for p in sorted(top, key=lambda q: q.pid):
        ranks = tree.ranks_under(p.pid)
        if ranks:
            found.append(Job(label=launcher_label(p), ranks=number(ranks), launcher_pid=p.pid))
            claimed.update(r.pid for r in ranks)
    loose = {
        p.pid
        for p in pythons
        if p.pid not in claimed and not launcher_pids.intersection(tree.ancestors(p.pid))
    }
    orphans: dict[tuple, list[RankProc]] = {}
    for r in tree.topmost_ranks(loose):  # topmost: a DataLoader worker's parent is the rank
        if "TORCHELASTIC_RUN_ID" in r.env:
            orphans.setdefault(r.job_key(), []).append(r)
    for key, ranks in orphans.items():
        found.append(
            Job(label=f"orphaned ranks (launcher gone, port {key[1]})", ranks=number(ranks))
        )
    if not found:
        from areal_cli import settings

        raise UsageError(
            f"no torchrun or areal job of user {settings.user()} runs on this host",
            hint="name one: areal doctor hang --pid PID (a rank or its torchrun) or --job E/T",
        )
    return found


class Tree:
    """Every process on this host and its parent, from one pass over /proc/*/stat (psutil's
    process_iter would build a Process object for each: several times slower on a busy
    node). `Proc` reads the few processes looked at closely."""

    def __init__(self) -> None:
        self.procs: dict[int, Proc] = {}
        self.parent: dict[int, int] = {}
        self.children: dict[int, list[int]] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    stat = f.read()
                ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # exited meanwhile
            pid = int(entry.name)
            self.parent[pid] = ppid
            self.children.setdefault(ppid, []).append(pid)

    def proc(self, pid: int) -> Proc | None:
        if pid not in self.procs:
            try:
                self.procs[pid] = Proc(pid)
            except ProcError:
                return None
        return self.procs[pid]

    def ancestors(self, pid: int) -> list[int]:
        out, seen = [], {pid}
        pid = self.parent.get(pid, 0)
        while pid and pid not in seen:
            out.append(pid)
            seen.add(pid)
            pid = self.parent.get(pid, 0)
        return out

    def descendants(self, root: int) -> list[int]:
        """The root (when it still runs) and everything under it."""
        out, todo = [], [root] if root in self.parent else []
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo.extend(self.children.get(pid, ()))
        return out

    def ranks_under(self, root: int) -> list[RankProc]:
        return self.topmost_ranks(self.descendants(root))

    def topmost_ranks(self, pids) -> list[RankProc]:
        """The processes among `pids` that carry RANK and have no such ancestor among them."""
        with_rank: dict[int, RankProc] = {}
        for pid in pids:
            p = self.proc(pid)
            if p is None:
                continue
            try:
                if p.status() == ZOMBIE or not is_python(p):
                    continue
            except ProcError:
                continue
            r = rank_proc(p)
            if r is not None and r.rank is not None:
                with_rank[pid] = r
        out = [
            r
            for pid, r in with_rank.items()
            # A DataLoader/compile worker of a rank inherited RANK: skip it.
            if not any(a in with_rank for a in self.ancestors(pid))
        ]
        return sorted(out, key=lambda r: (r.rank if r.rank is not None else 1 << 30, r.pid))


# --------------------------------------------------------------------------- helpers


def is_launcher(p: Proc) -> bool:
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


def _is_spawner(p: Proc, ranks: list[RankProc], tree: Tree) -> bool:
    """A parent not known as a launcher stands for the ranks below it only when they are of
    one rendezvous and it is not init or a process this doctor runs under (a shell, tmux,
    sshd: everything of the user's is below those)."""
    if len({r.job_key() for r in ranks}) != 1:
        return False
    return p.pid != 1 and p.pid not in {os.getpid(), *tree.ancestors(os.getpid())}


def is_python(p: Proc) -> bool:
    try:
        exe = p.exe()
    except (ProcError, OSError):
        exe = ""
    if exe and _PYTHON_EXE.match(os.path.basename(exe)):
        return True
    try:
        name = p.name()
    except ProcError:
        name = ""
    if _PYTHON_EXE.match(name or ""):
        return True
    try:
        with open(f"/proc/{p.pid}/maps") as f:
            return any("libpython" in line for line in f)
    except OSError:
        return False


def launcher_label(p: Proc) -> str:
    cmd = _cmdline(p)
    script = next((c for c in cmd[1:] if c.endswith(".py")), None)
    kind = (
        "torchrun" if "torch" in " ".join(cmd[:4]) or "torchrun" in " ".join(cmd[:2]) else "areal"
    )
    return f"{kind} pid {p.pid}" + (f" ({os.path.basename(script)})" if script else "")


def _process(pid: int) -> Proc:
    if pid <= 0:
        raise UsageError(f"{pid} is not a process id", hint="pids are positive integers")
    try:
        p = Proc(pid)
        if p.status() == ZOMBIE:
            raise UsageError(
                f"pid {pid} has exited (zombie, waiting for its parent to reap it)",
                hint="nothing to dump: its launcher's log tells how it ended",
            )
        return p
    except NoSuchProcess:
        raise UsageError(
            f"no process with pid {pid}",
            hint="`ps -ef | grep torchrun` or `areal ps` lists what runs",
        ) from None
    except AccessDenied:
        raise UsageError(f"pid {pid} cannot be inspected by this user") from None


def rank_proc(p: Proc) -> RankProc | None:
    try:
        env = p.environ()
        cmd = p.cmdline()
    except NoSuchProcess:
        return None
    except (AccessDenied, OSError):
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


def number(ranks: list[RankProc]) -> list[RankProc]:
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


def _cmdline(p: Proc) -> list[str]:
    try:
        return p.cmdline()
    except (ProcError, OSError):
        return []


def _describe(p: Proc) -> str:
    cmd = _cmdline(p)
    try:
        text = " ".join(cmd) if cmd else p.name()
    except ProcError:
        text = "exited"
    return text if len(text) <= 60 else text[:57] + "..."


def _hostname() -> str:
    from areal_cli import settings  # it imports pathlib: not on the way to the first dump

    return settings.hostname()


def _int(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None
