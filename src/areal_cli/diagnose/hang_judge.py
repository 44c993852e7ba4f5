"""`areal doctor hang`, the judging half: each job's verdict drawn from the dumps taken
(diagnose.hang samples them), the report with its evidence, as JSON and as a bundle to attach
to an issue. Imported while the first dumps run, not before them (diagnose.hang), so this
module's imports cost the doctor no time to its first dump.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from areal_cli import files, request_errors
from areal_cli.diagnose import flight, permissions, stacks
from areal_cli.diagnose.attach import AttachError
from areal_cli.diagnose.targets import Job
from areal_cli.diagnose.verdict import Analysis, RankSamples, analyze
from areal_cli.errors import UsageError


class TargetsExited(UsageError):
    """Every rank exited before or while it was dumped: nothing left to diagnose (exit 2)."""


class HangReport:
    """One job's verdict with its evidence."""

    def __init__(
        self,
        job: Job,
        analysis: Analysis,
        samples: int,
        dumps: dict[int, list[stacks.Dump]] | None = None,  # pid -> one per sample
        errors: list[dict] | None = None,
        elapsed_s: float = 0.0,
        # Seconds spent: preflight_s checking permissions (while the first dumps run), dump_s
        # running py-spy, wait_s between samples, flight_s asking the flight recorders,
        # judge_s classifying.
        timing: dict[str, float] | None = None,
        # rank -> its flight recorder's dump; flight_errors: rank -> why there is none.
        flights: dict[int, flight.RankFlight] | None = None,
        flight_errors: dict[int, str] | None = None,
        torch_analysis: list[str] | None = None,  # what torchfrtrace said
    ) -> None:
        self.job, self.analysis, self.samples = job, analysis, samples
        self.dumps = {} if dumps is None else dumps
        self.errors = [] if errors is None else errors
        self.elapsed_s = elapsed_s
        self.timing = {} if timing is None else timing
        self.flights = {} if flights is None else flights
        self.flight_errors = {} if flight_errors is None else flight_errors
        self.torch_analysis = [] if torch_analysis is None else torch_analysis

    @property
    def failed(self) -> bool:
        return bool(self.errors) or self.analysis.verdict is None

    def to_json(self) -> dict:
        analysis = self.analysis.to_json()
        if self.job.on_other_nodes:  # a cluster job: each rank's node
            node = {r.rank: r.node for r in self.job.ranks}
            for r in analysis.get("ranks", []):
                r["node"] = node.get(r["rank"])
        return {
            "job": self.job.to_json(),
            **analysis,
            "flight": {
                "ranks": sorted(self.flights),
                "errors": {str(r): e for r, e in sorted(self.flight_errors.items())},
                "torch_analysis": self.torch_analysis,
            },
            "samples": self.samples,
            "errors": self.errors,
            "elapsed_s": round(self.elapsed_s, 3),
            "timing": {k: round(v, 4) for k, v in self.timing.items()},
        }


def judge_all(
    jobs: list[Job], rounds: list[dict], tracer, asked: list[int], timing: dict,
    torch_analyzer: bool = False,
) -> list[HangReport]:  # fmt: skip
    """Every job's report from the rounds of dumps of its ranks on this host, with the flight
    recorders of the ranks `asked`; `timing` gains flight_s and judge_s, and each report
    carries it. Raises when no rank could be read (raise_unreadable)."""
    t0 = time.monotonic()
    # After the last sample: the recorder then says where the ranks stand as the last stacks do.
    flights = flight.gather(asked) if asked else {}
    timing["flight_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    reports = [judge(job, rounds, tracer, flights=flights) for job in jobs]
    for rep in reports if torch_analyzer else ():
        torch_analysis(rep)
    timing["judge_s"] = time.monotonic() - t0
    for rep in reports:
        rep.timing = dict(timing)
    if all(rep.analysis.verdict is None for rep in reports):
        raise_unreadable(reports)
    return reports


def judge(
    job: Job, rounds: list[dict], tracer, key=lambda r: r.pid, flights: dict | None = None
) -> HangReport:
    sourced: set[int] = set()
    for rd in rounds:
        for d in rd.values():
            if d.ok and id(d.threads) not in sourced:  # a kept dump shares its threads
                d.threads = stacks.with_source(d.threads)
                sourced.add(id(d.threads))
    per_rank = [
        RankSamples(rank=r.rank, pid=r.pid, dumps=[rd[key(r)] for rd in rounds if key(r) in rd])
        for r in job.ranks
    ]
    by_rank: dict[int, flight.RankFlight] = {}
    flight_errors: dict[int, str] = {}
    for r in job.ranks:
        got = (flights or {}).get(key(r))
        if isinstance(got, flight.RankFlight):
            by_rank[r.rank if r.rank is not None else got.rank] = got
        elif got is not None and not got.startswith("absent"):
            flight_errors[r.rank] = got
    analysis = analyze(
        per_rank,
        expected_ranks=job.expected_local_ranks(),
        multi_host=job.multi_host,
        flights=by_rank,
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
    return HangReport(
        job=job,
        analysis=analysis,
        samples=len(rounds),
        dumps={key(r): [rd[key(r)] for rd in rounds if key(r) in rd] for r in job.ranks},
        errors=errors,
        flights=by_rank,
        flight_errors=flight_errors,
    )


def torch_analysis(rep: HangReport) -> None:
    """torch's analyzer on a mismatch the recorder showed: its own words join the evidence.
    It runs in the ranks' interpreter (which has torch; the doctor never imports it)."""
    v = rep.analysis.verdict
    if v is None or v.kind not in ("shape_mismatch", "wrong_group") or not rep.flights:
        return
    pid = next((r.pid for r in rep.job.ranks if r.pid), None)
    try:
        # argv[0], not /proc/PID/exe: that resolves a venv's python to the base interpreter,
        # which lacks the venv's torch.
        python = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except (OSError, UnicodeDecodeError):
        return
    if not os.path.isabs(python):
        return
    with tempfile.TemporaryDirectory(prefix="areal-fr-") as d:
        said = flight.torch_analysis(list(rep.flights.values()), python, Path(d))
    rep.torch_analysis = said
    v.evidence += [f"torch's analyzer: {line}" for line in said if flight.is_finding(line)]


def raise_unreadable(reports: list[HangReport]) -> None:
    ranks = [r for rep in reports for r in rep.analysis.ranks]
    gone = [r for r in ranks if r.state == "missing" and r.pid]
    if gone and len(gone) == len([r for r in ranks if r.pid]):
        during = any(r.error == "the process exited during the dump" for r in gone)
        pids = ", ".join(str(r.pid) for r in gone[:8]) + (" ..." if len(gone) > 8 else "")
        raise TargetsExited(
            f"the process{'es' if len(gone) > 1 else ''} exited "
            f"{'during the dump' if during else 'before it could be dumped'} (pid {pids}): "
            "nothing is left to diagnose",
            hint="the job ended or restarted: its launcher's log (or `areal logs E/T`) says how",
        )
    errs = [e for rep in reports for e in rep.errors]
    first = errs[0] if errs else {"error": "no rank could be read", "fix": None}
    raise AttachError(
        f"py-spy could not read any rank: {first['error']}",
        hint=first.get("fix"),
        detail="\n".join(f"rank {e['rank']} (pid {e['pid']}): {e['error']}" for e in errs[:8]),
    )


def note_refused(reports: list[HangReport], registry: str) -> None:
    """A job that retries a refused request forever looks busy, or waits in a collective
    behind the rank that retries: each verdict of a job found by name (--job) names the
    servers of its trial that refuse their clients, with the last error
    (areal_cli.request_errors; read from the registry, nothing is asked of the servers)."""
    for rep in reports:
        v = rep.analysis.verdict
        experiment, _, trial = (rep.job.name or "").partition("/")
        if v is None or not trial:
            continue
        try:
            lines = request_errors.refusals(registry, [(experiment, trial)])
        except Exception:  # a registry that does not answer: the verdict stands as it is
            continue
        if lines:
            v.summary = "; ".join([v.summary, *lines])
            v.evidence.extend(lines)
            v.hint = v.hint or (
                "the trainer retries what a server refuses: fix the request or the server "
                "(its last error above; `areal ps --json` shows it whole)"
            )


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
    """Raw py-spy output per rank and sample taken plus summary.json, ready to attach to an
    issue. Private (files: 0700 folders, 0600 files, never through a symlink): stacks show
    what the user's processes hold."""
    out = files.private_dir(Path(out_dir))
    written = []
    for n, rep in enumerate(reports):
        sub = out if len(reports) == 1 else files.private_dir(out / f"job{n}")
        rank_of = {((r.node, r.pid) if r.node else r.pid): r.rank for r in rep.job.ranks}
        for key, all_dumps in rep.dumps.items():
            # A cluster job's dumps are keyed (node, pid): pids repeat across nodes.
            node, pid = key if isinstance(key, tuple) else (None, key)
            # A kept dump (the rank did not run since) is the one before it: written once.
            dumps = [(i, d) for i, d in enumerate(all_dumps) if not d.reused]
            for i, d in dumps:
                suffix = f"-sample{i}" if len(dumps) > 1 else ""
                where = f"-{node}" if node else ""
                path = sub / f"rank{rank_of.get(key)}{where}-pid{pid}{suffix}.json"
                if d.ok:
                    files.write_private(path, d.raw)
                else:
                    path = path.with_suffix(".error.txt")
                    files.write_private(path, f"{d.error_kind}: {d.error}\n")
                written.append(path)
        if rep.flights:
            fr = files.private_dir(sub / "flight-recorder")
            for rank, f in sorted(rep.flights.items()):
                path = fr / f"rank{rank}.json"
                text = json.dumps({"rank": rank, "groups": f.groups, "dump": f.raw})
                files.write_private(path, text)
                written.append(path)
            # torchfrtrace reads these as they are: `torchfrtrace DIR --prefix fr_trace_`
            written += flight.write_torch_dumps(list(rep.flights.values()), fr / "torch")
    summary = out / "summary.json"
    data = to_json(reports)
    data["host"] = os.uname().nodename
    data["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    files.write_private(summary, json.dumps(data, indent=2, default=str) + "\n")
    written.append(summary)
    return written
