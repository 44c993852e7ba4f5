"""`areal doctor hang`, the library half: check we may attach, dump every rank of every job
(several samples spread over about a second by default), classify, and keep the raw dumps for
a bug report.

One sample cannot tell a hang from a healthy job caught inside a collective, so a hang is only
called when nothing moved across the samples. Samples after the first cost little on a hung
job: a rank none of whose Python threads ran since the last sample is not dumped again.

Ranks on areal's worker runtime also answer over their doctor channel with torch's flight
recorder (diagnose.flight), asked once after the last sample, all ranks at once: the verdict
then knows each process group's collective numbers, ops, sizes and dtypes. Where it finds a
shape or group mismatch and a bundle is written (--out, the watchdog), torch's own analyzer
(`torchfrtrace`) is run on the dumps too, and what it says joins the evidence.
"""

from __future__ import annotations

import os
import sys
import time

from areal_cli.diagnose import stacks
from areal_cli.errors import EXIT_FAILED, ArealError, UsageError

# Imported before the first py-spy starts: what checks the permissions, judges the dumps and
# writes the bundle (dataclasses, pathlib, json) is imported while the first dumps run.
TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start-up cost)
if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from areal_cli.diagnose import flight, permissions
    from areal_cli.diagnose.targets import Job
    from areal_cli.diagnose.verdict import Analysis

    ProgressFn = Callable[[int, int, int], None]  # (sample index, dumps done, dumps total)

DEFAULT_SAMPLES = 3
DEFAULT_INTERVAL = 0.5  # seconds from one sample's start to the next


class AttachError(ArealError):
    """py-spy may not or could not read the ranks: exit 1, with the fix as hint."""

    exit_code = EXIT_FAILED


class TargetsExited(UsageError):
    """Every rank exited before or while it was dumped: nothing left to diagnose (exit 2)."""


class HangReport:
    """One job's verdict with its evidence. A plain class (not a dataclass): this module is
    imported on the way to the first dump, dataclasses meanwhile."""

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
        if self.job.scheduler_job_id:  # a cluster job: each rank's node
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


def diagnose(jobs: list[Job], **opts) -> list[HangReport]:
    """Dump and judge every rank of `jobs` (the options: `_diagnose`'s).

    The garbage collector is paused meanwhile: the imports and the parsed dumps make many
    objects and next to no cycles (16 ranks, one sample: 24 collections, 3.6-4.9 ms of CPU
    under load), and on a small host the doctor's own CPU time is taken from the py-spy
    processes. What it would have found is collected once it runs again."""
    import gc

    paused = gc.isenabled()
    gc.disable()
    try:
        return _diagnose(jobs, **opts)
    finally:
        if paused:
            gc.enable()


def _diagnose(
    jobs: list[Job],
    *,
    samples: int = DEFAULT_SAMPLES,
    interval: float = DEFAULT_INTERVAL,
    native: bool = False,
    show_locals: bool = False,
    timeout: float = stacks.DEFAULT_TIMEOUT,
    on_progress: ProgressFn | None = None,
    with_flight: bool = True,
    torch_analyzer: bool = False,
) -> list[HangReport]:
    """Dump and judge every rank of `jobs`, `samples` times, `interval` seconds apart (start to
    start). Raises AttachError when no rank can be read, TargetsExited when all exited.
    `torch_analyzer`: on a shape or group mismatch, also run torch's analyzer on the dumps (a
    few seconds: it imports torch), for a bundle nobody waits on."""
    cluster = [j for j in jobs if j.scheduler_job_id]
    if cluster:
        opts = dict(samples=samples, interval=interval, native=native,
                    show_locals=show_locals, timeout=timeout)  # fmt: skip
        reports = [_diagnose_on_nodes(j, **opts, with_flight=with_flight) for j in cluster]
        # No torch analyzer here: it runs with the ranks' interpreter, which is on their nodes.
        rest = [j for j in jobs if not j.scheduler_job_id]
        if rest:
            reports += diagnose(rest, **opts, on_progress=on_progress, with_flight=with_flight,
                                torch_analyzer=torch_analyzer)  # fmt: skip
        if all(rep.analysis.verdict is None for rep in reports):
            _raise_unreadable(reports)
        return reports
    started = time.monotonic()
    pyspy = stacks.require_pyspy()
    pids = [r.pid for j in jobs for r in j.ranks]
    samples = max(1, samples)
    asked: list[int] = []
    rounds: list[dict[int, stacks.Dump]] = []
    dump_s = wait_s = preflight_s = 0.0
    first_start = time.monotonic()
    for i in range(samples):
        pause = first_start + i * interval - time.monotonic()
        if pause > 0:
            time.sleep(pause)
            wait_s += pause
        done = 0

        def tick(_d: stacks.Dump, i: int = i) -> None:
            nonlocal done
            done += 1
            if on_progress:
                on_progress(i, done, len(pids))

        t0 = time.monotonic()
        pending = stacks.start_many(
            pids,
            pyspy=pyspy,
            native=native,
            show_locals=show_locals,
            timeout=timeout,
            previous=rounds[-1] if rounds else None,
            on_done=tick,
            # Counters after a dump serve the next sample only.
            counters=i < samples - 1,
        )
        if i == 0:
            # The first dumps start as soon as the ranks are known; what comes before them in
            # reason runs beside them: the permission check (an attach it finds impossible
            # stops the dumps; py-spy's version only matters for a py-spy older than the
            # ranks' Python), the imports that judge the dumps, the ranks' doctor channels.
            try:
                t_pre = time.monotonic()
                from areal_cli.diagnose import permissions

                version = _Answer(stacks.pyspy_version, pyspy)
                tracer = _check(pids, permissions.tracer_info(None))
                preflight_s = time.monotonic() - t_pre
                channel = _import_judges()
                # Only ranks with a doctor channel are asked for their flight recorder (a plain
                # torchrun script has none): one thread per rank that has nothing to say costs
                # more than its dump's judging.
                asked = [p for p in pids if channel.find(p) is not None] if with_flight else []
            except BaseException:
                pending.cancel()
                raise
        dumps = pending.wait()
        if i == 0:
            tracer = _check(pids, tracer, version.result())
        dump_s += time.monotonic() - t0
        rounds.append(dumps)
        if all(d.error_kind == "gone" for d in dumps.values()):
            break  # nothing left to sample

    from areal_cli.diagnose import flight

    t0 = time.monotonic()
    # After the last sample: the recorder then says where the ranks stand as the last stacks do.
    flights = flight.gather(asked) if asked else {}
    flight_s = time.monotonic() - t0
    t0 = time.monotonic()
    reports = [_judge(job, rounds, tracer, flights=flights) for job in jobs]
    for rep in reports if torch_analyzer else ():
        _torch_analysis(rep)
    judge_s = time.monotonic() - t0
    for rep in reports:
        rep.elapsed_s = time.monotonic() - started
        rep.timing = {
            "preflight_s": preflight_s,
            "dump_s": dump_s,
            "wait_s": wait_s,
            "flight_s": flight_s,
            "judge_s": judge_s,
        }
    if all(rep.analysis.verdict is None for rep in reports):
        _raise_unreadable(reports)
    return reports


def _import_judges():
    """Import the modules that judge the dumps (verdict, flight, collectives, the dumps' own
    types) and the doctor channel while the first dumps run rather than before them: that
    import and the py-spy processes overlap. The switch interval is shortened meanwhile: a dump
    thread whose py-spy finished waits for the GIL no longer than that before it reads the
    output and starts the next one. Returns the channel module."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, 0.0005))
    try:
        from areal_cli.diagnose import dumps, flight, verdict  # noqa: F401
        from areal_cli.worker import channel
    finally:
        sys.setswitchinterval(interval)
    return channel


def _diagnose_on_nodes(job: Job, **opts) -> HangReport:
    """A cluster job: every node sampled at once where its ranks run (diagnose.nodes); the
    ranks of a node that cannot be reached are errors naming it, the verdict is the others'."""
    from areal_cli.diagnose import flight, nodes, permissions
    from areal_cli.diagnose.targets import RankProc

    started = time.monotonic()
    found = nodes.sample(
        job.scheduler_job_id, job.nodes, job.marker, reach=job.reach, lead=job.lead, **opts
    )
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
    rep = _judge(job, rounds, permissions.tracer_info(None), key=lambda r: (r.node, r.pid),
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


def _judge(
    job: Job, rounds: list[dict], tracer, key=lambda r: r.pid, flights: dict | None = None
) -> HangReport:
    from areal_cli.diagnose import flight, permissions
    from areal_cli.diagnose.verdict import RankSamples, analyze

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


def _torch_analysis(rep: HangReport) -> None:
    """torch's analyzer on a mismatch the recorder showed: its own words join the evidence.
    It runs in the ranks' interpreter (which has torch; the doctor never imports it)."""
    v = rep.analysis.verdict
    if v is None or v.kind not in ("shape_mismatch", "wrong_group") or not rep.flights:
        return
    import tempfile
    from pathlib import Path

    pid = next((r.pid for r in rep.job.ranks if r.pid), None)
    try:
        # argv[0], not /proc/PID/exe: that resolves a venv's python to the base interpreter,
        # which lacks the venv's torch.
        python = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except (OSError, UnicodeDecodeError):
        return
    if not os.path.isabs(python):
        return
    from areal_cli.diagnose import flight

    with tempfile.TemporaryDirectory(prefix="areal-fr-") as d:
        said = flight.torch_analysis(list(rep.flights.values()), python, Path(d))
    rep.torch_analysis = said
    v.evidence += [f"torch's analyzer: {line}" for line in said if flight.is_finding(line)]


def _raise_unreadable(reports: list[HangReport]) -> None:
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


def preflight(pids: list[int], pyspy: str) -> permissions.TracerInfo:
    """Raise AttachError with the exact fix when the kernel or py-spy will refuse."""
    from areal_cli.diagnose import permissions

    return _check(pids, permissions.tracer_info(stacks.pyspy_version(pyspy)))


class _Answer:
    """fn(*args) run in a thread of its own; `result` waits for it."""

    def __init__(self, fn: Callable, *args) -> None:
        import threading

        self._value = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable, args: tuple) -> None:
        self._value = fn(*args)

    def result(self):
        self._thread.join()
        return self._value


def _check(
    pids: list[int], tracer: permissions.TracerInfo, pyspy_version: tuple[int, ...] | None = None
) -> permissions.TracerInfo:
    """`preflight` for `tracer`; with `pyspy_version` (learnt later), only what that version
    adds: whether it is too old for the ranks' Python. The tracer, with the version."""
    from areal_cli.diagnose import permissions

    if pyspy_version is not None:
        from dataclasses import replace

        tracer = replace(tracer, pyspy_version=pyspy_version)
        if permissions.pyspy_max_python(pyspy_version) is None:
            return tracer  # a release newer than the table: trusted
    old_pyspy = bool(
        tracer.pyspy_version and permissions.pyspy_max_python(tracer.pyspy_version) is not None
    )
    targets = [
        permissions.target_info(p, need_ancestry=tracer.ptrace_scope == 1, need_python=old_pyspy)
        for p in pids
    ]
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


def note_refused(reports: list[HangReport], registry: str) -> None:
    """A job that retries a refused request forever looks busy, or waits in a collective
    behind the rank that retries: each verdict of a job found by name (--job) names the
    servers of its trial that refuse their clients, with the last error
    (areal_cli.request_errors; read from the registry, nothing is asked of the servers)."""
    from areal_cli import request_errors

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
    import json
    from pathlib import Path

    from areal_cli import files
    from areal_cli.diagnose import flight

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
