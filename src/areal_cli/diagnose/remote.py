"""`doctor profile`, `doctor memory` and `doctor diverge` on the ranks of a cluster job, node by
node, the way `doctor hang` samples them (diagnose.nodes): on every node of the job at once,

    python -m areal_cli.diagnose.remote profile|memory|diverge [--pids P,..] [--marker M] ...

runs on that node (the scheduler's run_on_nodes: srun --overlap on Slurm, the job's actor on
Ray), does the work on the node's ranks (py-spy, /proc, the ranks' doctor channels, which are
Unix sockets and so only reachable there), and prints one JSON line:

    {"node": N, "ranks": [{pid, rank, ...}], "error": null | "why", ...what the command asks}

profile    "profiles": pid -> {"speedscope": gzip+base64 of py-spy's file} | {"error": ...};
           every node starts recording at the same moment (--start, an epoch time)
memory     "rows": one per rank (rss, CUDA allocator, cgroup), "host": the node's memory,
           "cgroups"; with --snapshot, "snapshots": pid -> {kind, name, data (gzip+base64)}
diverge    "answers": pid -> the rank's answer to --op (a channel request), or
           {"channel_error": why, "kind": ...}; --gap S asks twice, S seconds apart ("again")

The caller's side (`on_nodes`) runs it on every node and hands back each node's JSON, or why
the node gave none. Files come back inside the JSON: the caller writes them under its own
--out, which need not be visible from the nodes.
"""

from __future__ import annotations

import base64
import gzip
import json
import sys
import time

from areal_cli.diagnose.targets import Job
from areal_cli.errors import UsageError

# A recorded profile or snapshot larger than this stays on its node (named in the error).
MAX_FILE = 48 << 20


def pack(data: bytes) -> str:
    return base64.b64encode(gzip.compress(data, compresslevel=3)).decode()


def unpack(text: str) -> bytes:
    return gzip.decompress(base64.b64decode(text))


# -- the caller's side -----------------------------------------------------------------------


def on_nodes(
    job: Job, argv: list[str], timeout: float, per_node: dict[str, list[str]] | None = None
) -> dict[str, tuple[dict | None, str | None]]:
    """node -> (its JSON answer, why there is none) of `remote <argv>` run on every node of the
    cluster job at once, through its scheduler (Job.reach: Scheduler.run_on_nodes)."""
    if job.reach is None:
        raise UsageError(f"{job.label}: its scheduler gives no way to reach its nodes")

    def command(node: str) -> list[str]:
        out = [sys.executable, "-m", "areal_cli.diagnose.remote", *argv]
        if job.nodes.get(node):
            out += ["--pids", ",".join(map(str, job.nodes[node]))]
        if job.marker:
            out += ["--marker", job.marker]
        return out + list((per_node or {}).get(node, []))

    got = job.reach(job.scheduler_job_id, {n: command(n) for n in job.nodes}, timeout)
    out: dict[str, tuple[dict | None, str | None]] = {}
    for node in job.nodes:
        stdout, why = got.get(node, (None, f"node {node} was not reached"))
        try:
            data = json.loads((stdout or "").strip().splitlines()[-1])
        except (ValueError, IndexError):
            out[node] = (None, why or f"node {node} answered nothing")
            continue
        if not isinstance(data, dict):
            out[node] = (None, f"node {node} answered {str(data)[:80]!r}")
        elif data.get("error"):
            out[node] = (data, f"node {node}: {data['error']}")
        else:
            out[node] = (data, None)
    return out


# -- the node's side -------------------------------------------------------------------------


def _profile(a, ranks: list[dict]) -> dict:
    import tempfile
    from pathlib import Path

    from areal_cli.diagnose import profile

    pause = a.start - time.time()
    if pause > 0:
        time.sleep(min(pause, 30.0))
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="areal-profile-") as d:
        targets = [profile.RankProfile(r["rank"], r["pid"]) for r in ranks]
        paths = profile.run_pyspy(targets, Path(d), duration=a.duration, rate=a.rate,
                                  native=a.native)  # fmt: skip
        for t, path in zip(targets, paths, strict=True):
            if t.error is not None:
                out[str(t.pid)] = {"error": t.error}
            elif path.stat().st_size > MAX_FILE:
                out[str(t.pid)] = {"error": f"its profile ({path.stat().st_size} bytes) is too "
                                   f"large to bring back"}  # fmt: skip
            else:
                out[str(t.pid)] = {"speedscope": pack(path.read_bytes())}
    return {"profiles": out}


def _memory(a, ranks: list[dict]) -> dict:
    import tempfile
    from pathlib import Path

    from areal_cli.diagnose import memory

    rep = memory.gather_ranks([(r["rank"], r["pid"]) for r in ranks], "")
    out: dict = {"rows": [r.__dict__ for r in rep.ranks], "host": rep.host,
                 "cgroups": rep.cgroups}  # fmt: skip
    if a.snapshot:
        snaps: dict[str, dict] = {}
        with tempfile.TemporaryDirectory(prefix="areal-memory-") as d:
            for s in memory.snapshot(rep, Path(d)):
                entry = {k: v for k, v in s.items() if k != "path"}
                path = Path(s["path"]) if s.get("path") else None
                if path is not None and path.exists():
                    if path.stat().st_size > MAX_FILE:
                        entry.update(kind="error", error=f"{path.name} ({path.stat().st_size} "
                                     "bytes) is too large to bring back")  # fmt: skip
                    else:
                        entry.update(name=path.name, data=pack(path.read_bytes()))
                snaps[str(s["pid"])] = entry
        out["snapshots"] = snaps
    return out


def _diverge(a, ranks: list[dict]) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from areal_cli.worker import channel

    args: dict = {}
    if a.step is not None:
        args["step"] = a.step
    if a.wait is not None:
        args["wait"] = a.wait

    def one(pid: int):
        try:
            return channel.ask(pid, a.op, timeout=(a.wait or 0) + 5.0, **args)
        except channel.ChannelError as e:
            return {"channel_error": str(e), "kind": e.kind}

    def ask_all() -> dict[str, dict]:
        pids = [r["pid"] for r in ranks]
        with ThreadPoolExecutor(max_workers=min(32, len(pids) or 1)) as ex:
            return {str(p): got for p, got in zip(pids, ex.map(one, pids), strict=True)}

    out: dict = {"answers": ask_all(), "at": time.time()}
    if a.gap:
        time.sleep(a.gap)
        out["again"] = ask_all()
    return out


def node_main(argv: list[str] | None = None) -> int:
    import argparse

    from areal_cli.diagnose import nodes

    ap = argparse.ArgumentParser(prog="python -m areal_cli.diagnose.remote")
    ap.add_argument("what", choices=("profile", "memory", "diverge"))
    ap.add_argument("--pids", default="")
    ap.add_argument("--marker")
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--rate", type=int, default=100)
    ap.add_argument("--native", action="store_true")
    ap.add_argument("--start", type=float, default=0.0)
    ap.add_argument("--snapshot", action="store_true")
    ap.add_argument("--op", default="progress")
    ap.add_argument("--step", type=int)
    ap.add_argument("--wait", type=float)
    ap.add_argument("--gap", type=float, default=0.0)
    started = time.monotonic()
    out: dict = {"node": nodes._node_here(), "ranks": []}
    try:
        a = ap.parse_args(argv)
        pids = [int(p) for p in a.pids.split(",") if p.strip()]
        out["ranks"] = ranks = nodes._ranks_here(pids, a.marker)
        out.update({"profile": _profile, "memory": _memory, "diverge": _diverge}[a.what](a, ranks))
    except SystemExit as e:  # argparse: a caller of another version; said, not raised
        out["error"] = f"bad arguments {argv or sys.argv[1:]} (exit {e.code})"
    except Exception as e:  # reported to the caller, which names this node
        out["error"] = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
    out["took_s"] = round(time.monotonic() - started, 3)
    print(json.dumps(out, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(node_main())
