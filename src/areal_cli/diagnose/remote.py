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

The caller's side (diagnose.remote_call) runs it on every node and hands back each node's
JSON, or why the node gave none. Files come back inside the JSON: the caller writes them under
its own --out, which need not be visible from the nodes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from areal_cli.diagnose import memory, nodes, profile
from areal_cli.diagnose.remote_call import MAX_FILE, pack
from areal_cli.worker import channel

# -- the node's side -------------------------------------------------------------------------


def _profile(a, ranks: list[dict]) -> dict:
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
