"""`areal doctor hang` on a cluster job, the caller's side: every node sampled at once where
its ranks run (diagnose.nodes, through the job's way to reach them), the answers joined into
one set of rounds and judged as on one host (diagnose.hang_judge).

Apart from diagnose.nodes, whose node side starts on every node for each look and so imports
no more than it needs there.
"""

from __future__ import annotations

import time

from areal_cli.diagnose import flight, nodes, permissions, stacks
from areal_cli.diagnose.hang_judge import HangReport, judge
from areal_cli.diagnose.targets import Job, RankProc


def diagnose(job: Job, **opts) -> HangReport:
    """`doctor hang` on a cluster job: every node sampled at once where its ranks run, then
    judged as on one host (diagnose.hang_judge); the ranks of a node that cannot be reached
    are errors naming it, the verdict is the others'."""
    started = time.monotonic()
    found = nodes.sample(job, **opts)
    dump_s = time.monotonic() - started
    flights: dict[tuple, flight.RankFlight | str] = {}
    known = {(r.node, r.pid): r for r in job.ranks}
    ranks: dict[tuple, RankProc] = {}
    rounds: list[dict[tuple, stacks.Dump]] = [{} for _ in range(max(1, opts["samples"]))]
    unreachable = []
    for node, res in found.items():
        for r in res.ranks:
            ranks[(node, r["pid"])] = RankProc(
                pid=r["pid"], rank=r["rank"], local_rank=r["local_rank"],
                world_size=r["world_size"], local_world_size=r["local_world_size"],
                cmdline=[], node=node,
            )  # fmt: skip
        for i, rd in enumerate(res.rounds[: len(rounds)]):
            for pid, d in rd.items():
                rounds[i][(node, pid)] = d
        for pid, answer in res.flights.items():
            try:
                flights[(node, pid)] = (
                    flight.parse(answer, pid=pid) if isinstance(answer, dict) else str(answer)
                )
            except (ValueError, TypeError, KeyError) as e:
                flights[(node, pid)] = f"failed: the dump could not be read ({e})"
        if res.error:
            unreachable.append((node, res.error))
            for key, r in known.items():
                if r.node == node and key not in ranks:
                    ranks[key] = r
                    for rd in rounds:
                        rd[key] = stacks.Dump(r.pid, error=res.error, error_kind="unreachable")
    for key, r in known.items():  # in the table, but gone from its node
        if key not in ranks:
            ranks[key] = r
            for rd in rounds:
                rd[key] = stacks.Dump(r.pid, error="the process exited", error_kind="gone")
    job.ranks = sorted(ranks.values(), key=lambda r: r.rank if r.rank is not None else 1 << 30)
    rep = judge(job, rounds, permissions.tracer_info(None), key=lambda r: (r.node, r.pid),
                 flights=flights)  # fmt: skip
    for node, error in unreachable:
        if not any(e.get("node") == node for e in rep.errors):
            rep.errors.append({"rank": None, "pid": None, "node": node, "kind": "unreachable",
                               "error": error, "fix": None})  # fmt: skip
    for e in rep.errors:
        if e["kind"] == "unreachable":
            e["fix"] = (
                "`sinfo -R` and `scontrol show node NODE` say why; the verdict is the other nodes'"
            )
    rep.elapsed_s = time.monotonic() - started
    rep.timing = {"dump_s": dump_s}
    return rep
