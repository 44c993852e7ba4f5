"""`areal doctor memory`: what each rank holds, beside the limits that end it.

Per rank: resident memory (psutil, every process) and, for a rank on areal's worker runtime
that uses CUDA, torch's allocator (allocated, reserved, peak) asked over the doctor channel.
Beside them: the host's memory and each rank's cgroup limit and usage (v2 memory.max /
memory.current, v1 memory.limit_in_bytes / memory.usage_in_bytes), where the kernel's OOM
killer or a scheduler ends a job.

`snapshot(dir)`: on CUDA, each rank dumps torch's memory snapshot (the pickle
pytorch.org/memory_viz reads); a rank without CUDA gets its RSS breakdown from
/proc/PID/smaps_rollup (anonymous, file-backed, shared, swap) instead.

A cluster job's ranks are read on their nodes, all at once (diagnose.remote): each row names
its node, each node's memory stands beside its ranks, and snapshots come back to the caller's
folder as rankN-NODE.*.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from areal_cli.diagnose import remote_call
from areal_cli.diagnose.profile import output_dir
from areal_cli.diagnose.targets import Job
from areal_cli.worker import channel

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass
class RankMemory:
    rank: int | None
    pid: int
    rss: int | None
    cuda: dict | None = None  # torch's allocator, from the channel
    cgroup: str | None = None
    channel: str | None = None  # why the channel gave nothing ("absent", ...)
    error: str | None = None
    node: str | None = None  # a rank of a cluster job: the node it runs on


@dataclass
class MemoryReport:
    job: str
    ranks: list[RankMemory]
    host: dict
    cgroups: dict[str, dict] = field(default_factory=dict)
    most: dict | None = None
    snapshots: list[dict] = field(default_factory=list)
    # A cluster job: node -> that node's memory (host) and cgroups; errors: node -> why not read.
    nodes: dict[str, dict] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def gather(job: Job, snapshot_dir: str | Path | None = None) -> MemoryReport:
    """Each rank's memory; with `snapshot_dir`, each rank's snapshot written there too."""
    if snapshot_dir is not None:
        output_dir(Path(snapshot_dir))  # a bad folder is exit 2 before any work
    if job.on_other_nodes:
        return _gather_on_nodes(job, snapshot_dir)
    pairs = [(r.rank if r.rank is not None else i, r.pid) for i, r in enumerate(job.ranks)]
    rep = gather_ranks(pairs, job.name or job.label)
    if snapshot_dir is not None:
        snapshot(rep, snapshot_dir)
    return rep


def _gather_on_nodes(job: Job, snapshot_dir: str | Path | None) -> MemoryReport:
    """Every node of a cluster job read at once where its ranks run (diagnose.remote); the
    snapshots come back inside the answers and are written under `snapshot_dir`."""
    rows: list[RankMemory] = []
    nodes: dict[str, dict] = {}
    errors: dict[str, str] = {}
    cgroups: dict[str, dict] = {}
    snaps: list[dict] = []
    argv = ["memory"] + (["--snapshot"] if snapshot_dir is not None else [])
    for node, (data, why) in remote_call.on_nodes(job, argv, timeout=120.0).items():
        if why:
            errors[node] = why
        if data is None:
            continue
        for row in data.get("rows", []):
            rows.append(RankMemory(**{**row, "node": node}))
            got = (data.get("snapshots") or {}).get(str(row["pid"]))
            if got is None or snapshot_dir is None:
                continue
            entry = {k: v for k, v in got.items() if k not in ("data", "name")}
            entry["node"] = node
            if got.get("data"):
                stem, _, ext = got["name"].partition(".")
                path = Path(snapshot_dir) / f"{stem}-{node}.{ext}"
                path.write_bytes(remote_call.unpack(got["data"]))
                entry["path"] = str(path.resolve())
            snaps.append(entry)
        nodes[node] = {"host": data.get("host"), "cgroups": list(data.get("cgroups") or {})}
        for cg, limits in (data.get("cgroups") or {}).items():
            cgroups[f"{node}:{cg}"] = {**limits, "node": node}
    rows.sort(key=lambda r: (r.rank if r.rank is not None else 1 << 30, r.pid))
    return MemoryReport(job.name or job.label, rows, {}, cgroups, most=_most(rows),
                        snapshots=sorted(snaps, key=lambda e: (e["rank"], e["pid"])),
                        nodes=nodes, errors=errors)  # fmt: skip


def gather_ranks(pairs: list[tuple[int | None, int]], label: str) -> MemoryReport:
    """What the processes (rank, pid) of this host hold, beside this host's limits."""
    ranks = []
    cgroups: dict[str, dict] = {}
    for i, (rank, pid) in enumerate(pairs):
        rank = rank if rank is not None else i
        rm = RankMemory(rank, pid, None)
        try:
            rm.rss = psutil.Process(pid).memory_info().rss
        except psutil.Error as e:
            rm.error = f"cannot read pid {pid}: {type(e).__name__}"
        rm.cgroup = cgroup_of(pid)
        if rm.cgroup is not None and rm.cgroup not in cgroups:
            cgroups[rm.cgroup] = cgroup_limits(rm.cgroup)
        try:
            rm.cuda = channel.ask(pid, "memory", timeout=5.0).get("cuda")
        except channel.ChannelError as e:
            rm.channel = e.kind
        ranks.append(rm)
    vm = psutil.virtual_memory()
    host = {"total": vm.total, "available": vm.available, "used": vm.total - vm.available}
    return MemoryReport(label, ranks, host, cgroups, most=_most(ranks))


def _most(ranks: list[RankMemory]) -> dict | None:
    on_cuda = [r for r in ranks if r.cuda]
    if on_cuda:
        top = max(on_cuda, key=lambda r: r.cuda["reserved"])
        return {"rank": top.rank, "pid": top.pid, "node": top.node, "what": "cuda reserved",
                "bytes": top.cuda["reserved"]}  # fmt: skip
    known = [r for r in ranks if r.rss is not None]
    if not known:
        return None
    top = max(known, key=lambda r: r.rss)
    return {"rank": top.rank, "pid": top.pid, "node": top.node, "what": "rss", "bytes": top.rss}


def cgroup_of(pid: int) -> str | None:
    """The process's memory cgroup path: v2's unified entry, else v1's memory controller."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    v2 = None
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "memory" in controllers.split(","):
            return "v1:" + path  # hybrid hosts list "0::" too, without the memory controller
        if hid == "0" and controllers == "":
            v2 = "v2:" + path
    return v2


def cgroup_limits(cg: str, root: Path = CGROUP_ROOT) -> dict:
    """Limit and usage of a cgroup named by cgroup_of ('v2:/user.slice/...'). Walks up to
    the tightest limit: a child without one is bounded by its parent's."""
    version, _, path = cg.partition(":")
    if version == "v2":
        base, limit_f, usage_f, peak_f = root, "memory.max", "memory.current", "memory.peak"
    else:
        base = root / "memory"
        limit_f, usage_f, peak_f = (
            "memory.limit_in_bytes",
            "memory.usage_in_bytes",
            ("memory.max_usage_in_bytes"),
        )
    here = base / path.lstrip("/")
    if not here.is_dir():
        here = base  # a cgroup namespace: the process's own cgroup is the mount's root
    out: dict = {"version": version, "path": path, "limit": None, "limit_at": None,
                 "usage": _read_int(here / usage_f), "peak": _read_int(here / peak_f)}  # fmt: skip
    d = here
    while True:
        lim = _read_int(d / limit_f)
        # v1 spells "no limit" as a huge page-rounded number.
        if lim is not None and lim < (1 << 62) and (out["limit"] is None or lim < out["limit"]):
            out["limit"], out["limit_at"] = lim, "/" + str(d.relative_to(base)).lstrip(".")
        if d == base or base not in d.parents:
            break
        d = d.parent
    return out


def _read_int(p: Path) -> int | None:
    try:
        text = p.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def smaps_rollup(pid: int) -> dict[str, int]:
    """The kernel's RSS breakdown of a process in bytes (Rss, Pss, Anonymous, Swap, ...)."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[key.strip()] = int(parts[0]) * 1024
    return out


def snapshot(rep: MemoryReport, out_dir: str | Path) -> list[dict]:
    """One file per rank under out_dir: torch's CUDA snapshot, or the RSS breakdown."""
    out = Path(out_dir)
    output_dir(out)
    done = []
    for r in rep.ranks:
        entry: dict = {"rank": r.rank, "pid": r.pid}
        if r.cuda:
            path = (out / f"rank{r.rank}.memory_snapshot.pickle").resolve()
            try:
                got = channel.ask(r.pid, "memory_snapshot", timeout=60.0, path=str(path))
                entry.update(kind="cuda_snapshot", path=got["written"],
                             history_started=got.get("history_started"))  # fmt: skip
            except channel.ChannelError as e:
                entry.update(kind="error", error=str(e))
        else:
            path = out / f"rank{r.rank}.smaps_rollup.json"
            try:
                path.write_text(json.dumps(smaps_rollup(r.pid), indent=1))
                entry.update(kind="smaps_rollup", path=str(path))
            except OSError as e:
                entry.update(kind="error", error=f"/proc/{r.pid}/smaps_rollup: {e}")
        done.append(entry)
    rep.snapshots = done
    return done
