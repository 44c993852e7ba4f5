"""`areal doctor hang`, the library half: check we may attach, dump every rank of every job at
once (several rounds with --samples), classify, and keep the raw dumps for a bug report."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from areal_cli.diagnose import permissions, stacks
from areal_cli.diagnose.targets import Job
from areal_cli.diagnose.verdict import Analysis, RankSamples, analyze
from areal_cli.errors import EXIT_FAILED, ArealError


class AttachError(ArealError):
    """py-spy may not or could not read the ranks: exit 1, with the fix as hint."""

    exit_code = EXIT_FAILED


@dataclass
class HangReport:
    job: Job
    analysis: Analysis
    samples: int
    dumps: dict[int, list[stacks.Dump]] = field(default_factory=dict)  # pid -> one per sample
    errors: list[dict] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def failed(self) -> bool:
        return bool(self.errors) or self.analysis.verdict is None

    def to_json(self) -> dict:
        return {
            "job": self.job.to_json(),
            **self.analysis.to_json(),
            "samples": self.samples,
            "errors": self.errors,
            "elapsed_s": round(self.elapsed_s, 3),
        }


ProgressFn = Callable[[int, int, int], None]  # (sample index, dumps done, dumps total)


def diagnose(
    jobs: list[Job],
    *,
    samples: int = 1,
    interval: float = 0.5,
    native: bool = False,
    show_locals: bool = False,
    timeout: float = stacks.DEFAULT_TIMEOUT,
    on_progress: ProgressFn | None = None,
) -> list[HangReport]:
    """Dump and judge every rank of `jobs`. Raises AttachError when nothing can be read."""
    started = time.monotonic()
    pyspy = stacks.require_pyspy()
    pids = [r.pid for j in jobs for r in j.ranks]
    tracer = preflight(pids, pyspy)

    rounds: list[dict[int, stacks.Dump]] = []
    for i in range(max(1, samples)):
        if i:
            time.sleep(interval)
        done = 0

        def tick(_d: stacks.Dump, i: int = i) -> None:
            nonlocal done
            done += 1
            if on_progress:
                on_progress(i, done, len(pids))

        dumps = stacks.dump_many(
            pids, pyspy=pyspy, native=native, show_locals=show_locals, timeout=timeout, on_done=tick
        )
        for d in dumps.values():
            if d.ok:
                d.threads = stacks.with_source(d.threads)
        rounds.append(dumps)

    reports = []
    for job in jobs:
        per_rank = [
            RankSamples(rank=r.rank, pid=r.pid, dumps=[rd[r.pid] for rd in rounds])
            for r in job.ranks
        ]
        analysis = analyze(
            per_rank, expected_ranks=job.expected_local_ranks(), multi_host=job.multi_host
        )
        errors = [
            {
                "rank": r.rank,
                "pid": r.pid,
                "kind": r.error_kind or "failed",
                "error": r.error,
                "fix": permissions.explain_failure(r.error_kind or "failed", tracer),
            }
            for r in analysis.ranks
            if r.state == "error"
        ]
        reports.append(
            HangReport(
                job=job,
                analysis=analysis,
                samples=len(rounds),
                dumps={r.pid: [rd[r.pid] for rd in rounds] for r in job.ranks},
                errors=errors,
                elapsed_s=time.monotonic() - started,
            )
        )
    if all(rep.analysis.verdict is None for rep in reports):
        errs = [e for rep in reports for e in rep.errors]
        first = errs[0] if errs else {"error": "no rank could be read", "fix": None}
        raise AttachError(
            f"py-spy could not read any rank: {first['error']}",
            hint=first.get("fix"),
            detail="\n".join(f"rank {e['rank']} (pid {e['pid']}): {e['error']}" for e in errs[:8]),
        )
    return reports


def preflight(pids: list[int], pyspy: str) -> permissions.TracerInfo:
    """Raise AttachError with the exact fix when the kernel or py-spy will refuse."""
    tracer = permissions.tracer_info(stacks.pyspy_version(pyspy))
    targets = [permissions.target_info(p, need_ancestry=tracer.ptrace_scope == 1) for p in pids]
    found = permissions.problems(tracer, targets)
    if found:
        first = found[0]
        detail = "\n".join(
            f"{p.message}" + (f" (pids {', '.join(map(str, p.pids[:8]))})" if p.pids else "")
            for p in found[1:]
        )
        raise AttachError(
            f"cannot attach to the ranks: {first.message}",
            hint=first.fix,
            detail=detail or None,
        )
    return tracer


def primary(reports: list[HangReport]) -> HangReport:
    """The report to show first: a job that hangs beats one that does not."""
    for rep in reports:
        v = rep.analysis.verdict
        if v is not None and v.kind != "no_hang":
            return rep
    return reports[0]


def to_json(reports: list[HangReport]) -> dict:
    """One job: its report. Several: the most interesting one at the top level, all in `jobs`."""
    top = primary(reports).to_json()
    if len(reports) > 1:
        top["jobs"] = [r.to_json() for r in reports]
    return top


def write_bundle(reports: list[HangReport], out_dir: str | Path) -> list[Path]:
    """Raw py-spy output per rank and sample plus summary.json, ready to attach to an issue."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for n, rep in enumerate(reports):
        sub = out if len(reports) == 1 else out / f"job{n}"
        sub.mkdir(parents=True, exist_ok=True)
        rank_of = {r.pid: r.rank for r in rep.job.ranks}
        for pid, dumps in rep.dumps.items():
            for i, d in enumerate(dumps):
                suffix = f"-sample{i}" if len(dumps) > 1 else ""
                path = sub / f"rank{rank_of.get(pid)}-pid{pid}{suffix}.json"
                if d.ok:
                    path.write_text(d.raw)
                else:
                    path = path.with_suffix(".error.txt")
                    path.write_text(f"{d.error_kind}: {d.error}\n")
                written.append(path)
    summary = out / "summary.json"
    data = to_json(reports)
    data["host"] = os.uname().nodename
    data["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    summary.write_text(json.dumps(data, indent=2, default=str) + "\n")
    written.append(summary)
    return written
