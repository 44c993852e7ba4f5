"""Stacks (and flight recorders) of ranks on other nodes of a cluster job: per node, one

    python -m areal_cli.diagnose.nodes --samples N ...

run there the job's way (Job.run_on_nodes: the `reach` its scheduler handed in, Slurm's srun
--overlap, a Ray actor on the node) runs the same sampling as a local `areal doctor hang` on
that node's ranks, all nodes at once, and sends its dumps back as JSON, with each rank's flight
recorder asked over its doctor channel (a Unix socket, so asked on the node) after the last
sample. The ranks are the pids the rank table names for the node, or, where the table has
none, the processes of the job there (its marker) that carry RANK. The caller's side that
judges the answers is diagnose.hang_nodes.

A node that cannot be reached (down, or its scheduler refused) gives an error for each of its
ranks, naming the node; the verdict is drawn from the others.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field

from areal_cli import procs
from areal_cli.diagnose import attach, flight, stacks
from areal_cli.diagnose.targets import Job, Tree, rank_proc

Key = tuple[str, int]  # (node, pid): pids repeat across nodes


@dataclass
class NodeResult:
    node: str
    ranks: list[dict]  # {pid, rank, local_rank, world_size, local_world_size}
    rounds: list[dict[int, stacks.Dump]]
    error: str | None = None
    # pid -> the rank's flight-recorder answer over its doctor channel, or why there is none
    flights: dict[int, dict | str] = field(default_factory=dict)


def sample(
    job: Job,
    *,
    samples: int,
    interval: float,
    native: bool = False,
    show_locals: bool = False,
    timeout: float = stacks.DEFAULT_TIMEOUT,
    python: str | None = None,
    with_flight: bool = True,
) -> dict[str, NodeResult]:
    """node → what its ranks' stacks (and flight recorders) were, every node of the cluster
    job sampled at the same time, reached the job's way (Job.run_on_nodes). `job.nodes` maps
    each node to the pids the rank table names there (empty: find the job's ranks there);
    `job.lead`: how far ahead the common first moment lies (the time to start on every node)."""
    nodes, marker = job.nodes, job.marker
    start = time.time() + job.lead
    limit = 30 + samples * (interval + timeout)

    def command(node: str) -> list[str]:
        argv = [
            python or sys.executable, "-m", "areal_cli.diagnose.nodes",
            "--samples", str(samples), "--interval", str(interval), "--timeout", str(timeout),
            "--start", f"{start:.3f}",
        ]  # fmt: skip
        if nodes[node]:
            argv += ["--pids", ",".join(map(str, nodes[node]))]
        if marker:
            argv += ["--marker", marker]
        if native:
            argv.append("--native")
        if show_locals:
            argv.append("--locals")
        if not with_flight:
            argv.append("--no-flight")
        return argv

    def result(node: str, stdout: str | None, why: str | None) -> NodeResult:
        try:
            data = json.loads((stdout or "").strip().splitlines()[-1])
        except (ValueError, IndexError):
            return NodeResult(node, [], [], why or f"node {node} answered nothing")
        rounds = [{int(pid): _dump(d) for pid, d in rd.items()} for rd in data.get("rounds", [])]
        flights = {int(pid): f for pid, f in (data.get("flights") or {}).items()}
        return NodeResult(node, data.get("ranks", []), rounds, data.get("error"), flights)

    return {n: result(n, *got) for n, got in job.run_on_nodes(command, limit).items()}


def _dump(d: dict) -> stacks.Dump:
    threads = []
    if d.get("raw") and not d.get("error"):
        try:
            threads = stacks.parse_pyspy_json(d["raw"])
        except ValueError:
            pass
    return stacks.Dump(
        pid=d["pid"],
        threads=threads,
        raw=d.get("raw", ""),
        error=d.get("error"),
        error_kind=d.get("error_kind"),
        taken_at=d.get("taken_at", 0.0),
        elapsed_s=d.get("elapsed_s", 0.0),
        counters={int(k): tuple(v) for k, v in (d.get("counters") or {}).items()},
        ran=None if d.get("ran") is None else {int(k): v for k, v in d["ran"].items()},
        reused=bool(d.get("reused")),
    )


# -- the node's side ------------------------------------------------------------------------


def _node_here() -> str | None:
    """The node its scheduler says this is (several may share one host), or None."""
    return os.environ.get("AREAL_NODE_NAME")


def _ranks_here(pids: list[int], marker: str | None) -> list[dict]:
    """The ranks to dump on this node: the given pids, or the job's processes carrying RANK."""
    tree = Tree()
    here = _node_here()
    candidates = set(pids)
    if not candidates and marker:
        for p in procs.find_marked(marker):
            try:
                env = p.environ()
                node = env.get("AREAL_NODE_NAME")
            except Exception:
                continue
            # Several nodes (slurmd, raylets) may share a host: only this node's ranks.
            if here is None or node in (None, here):
                candidates.add(p.pid)
    out = []
    for r in tree.topmost_ranks(candidates) if not pids else _given(tree, pids):
        out.append({"pid": r.pid, "rank": r.rank, "local_rank": r.local_rank,
                    "world_size": r.world_size, "local_world_size": r.local_world_size})  # fmt: skip
    return out


def _given(tree, pids: list[int]):
    out = []
    for pid in pids:
        p = tree.proc(pid)
        r = rank_proc(p) if p is not None else None
        if r is not None:
            out.append(r)
    return out


def _to_json(d: stacks.Dump) -> dict:
    return {
        "pid": d.pid,
        "raw": d.raw if d.ok else "",
        "error": d.error,
        "error_kind": d.error_kind,
        "taken_at": d.taken_at,
        "elapsed_s": d.elapsed_s,
        "counters": {str(k): list(v) for k, v in d.counters.items()},
        "ran": None if d.ran is None else {str(k): v for k, v in d.ran.items()},
        "reused": d.reused,
    }


def node_main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m areal_cli.diagnose.nodes")
    ap.add_argument("--pids", default="")
    ap.add_argument("--marker")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--timeout", type=float, default=stacks.DEFAULT_TIMEOUT)
    ap.add_argument("--start", type=float, default=0.0)
    ap.add_argument("--native", action="store_true")
    ap.add_argument("--locals", action="store_true")
    ap.add_argument("--no-flight", action="store_true")
    a = ap.parse_args(argv)
    out: dict = {"node": _node_here(), "ranks": [], "rounds": []}
    try:
        pids = [int(p) for p in a.pids.split(",") if p.strip()]
        out["ranks"] = ranks = _ranks_here(pids, a.marker)
        pyspy = stacks.require_pyspy()
        attach.preflight([r["pid"] for r in ranks], pyspy)
        first = max(a.start, time.time())
        previous = None
        for i in range(max(1, a.samples)):
            pause = first + i * a.interval - time.time()
            if pause > 0:
                time.sleep(pause)
            dumps = stacks.dump_many(
                [r["pid"] for r in ranks], pyspy=pyspy, native=a.native,
                show_locals=a.locals, timeout=a.timeout, previous=previous,
            )  # fmt: skip
            out["rounds"].append({str(pid): _to_json(d) for pid, d in dumps.items()})
            previous = dumps
        if not a.no_flight:
            # After the last sample, as on one host: the recorder says where the ranks stand
            # as the last stacks do. The channel is a Unix socket: asked here, on the node.
            asked = flight.ask_all([r["pid"] for r in ranks])
            out["flights"] = {str(pid): got for pid, got in asked.items()}
    except Exception as e:  # reported to the controller, which names this node
        out["error"] = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(node_main())
