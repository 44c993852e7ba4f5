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

This module samples; diagnose.hang_judge judges and writes the report, diagnose.hang_nodes
samples a cluster job's ranks where they run.
"""

from __future__ import annotations

import sys
import time

from areal_cli.diagnose import stacks

# Imported before the first py-spy starts: what checks the permissions, judges the dumps and
# writes the bundle (dataclasses, pathlib, json) is imported while the first dumps run.
TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a start-up cost)
if TYPE_CHECKING:
    from collections.abc import Callable

    from areal_cli.diagnose import permissions
    from areal_cli.diagnose.hang_judge import HangReport
    from areal_cli.diagnose.targets import Job

    ProgressFn = Callable[[int, int, int], None]  # (sample index, dumps done, dumps total)

DEFAULT_SAMPLES = 3
DEFAULT_INTERVAL = 0.5  # seconds from one sample's start to the next


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
    opts = dict(samples=samples, interval=interval, native=native, show_locals=show_locals,
                timeout=timeout)  # fmt: skip
    if any(j.on_other_nodes for j in jobs):
        return _diagnose_split(jobs, opts, on_progress, with_flight, torch_analyzer)
    started = time.monotonic()
    rounds, tracer, asked, timing = _sample(
        [r.pid for j in jobs for r in j.ranks], **opts, on_progress=on_progress,
        with_flight=with_flight,
    )  # fmt: skip
    reports = _judges().judge_all(jobs, rounds, tracer, asked, timing, torch_analyzer)
    for rep in reports:
        rep.elapsed_s = time.monotonic() - started
    return reports


def _diagnose_split(
    jobs: list[Job], opts: dict, on_progress, with_flight: bool, torch_analyzer: bool
) -> list[HangReport]:
    """Jobs on other nodes each sampled there (diagnose.nodes), the others here."""
    from areal_cli.diagnose import hang_nodes  # psutil with it: for cluster jobs only

    reports = [hang_nodes.diagnose(j, **opts, with_flight=with_flight)
               for j in jobs if j.on_other_nodes]  # fmt: skip
    # No torch analyzer there: it runs with the ranks' interpreter, which is on their nodes.
    rest = [j for j in jobs if not j.on_other_nodes]
    if rest:
        reports += diagnose(rest, **opts, on_progress=on_progress, with_flight=with_flight,
                            torch_analyzer=torch_analyzer)  # fmt: skip
    if all(rep.analysis.verdict is None for rep in reports):
        _judges().raise_unreadable(reports)
    return reports


def _sample(
    pids: list[int],
    *,
    samples: int,
    interval: float,
    native: bool,
    show_locals: bool,
    timeout: float,
    on_progress: ProgressFn | None,
    with_flight: bool,
) -> tuple[list[dict[int, stacks.Dump]], permissions.TracerInfo, list[int], dict[str, float]]:
    """Every pid dumped `samples` times: the rounds of dumps, the tracer checked, the pids to
    ask for their flight recorder, and the seconds spent (preflight_s checking permissions,
    while the first dumps run; dump_s running py-spy; wait_s between samples)."""
    pyspy = stacks.require_pyspy()
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
                from areal_cli.diagnose import attach

                version = _Answer(stacks.pyspy_version, pyspy)
                tracer = attach.check(pids)
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
            tracer = attach.check(pids, tracer, version.result())
        dump_s += time.monotonic() - t0
        rounds.append(dumps)
        if all(d.error_kind == "gone" for d in dumps.values()):
            break  # nothing left to sample
    return rounds, tracer, asked, {"preflight_s": preflight_s, "dump_s": dump_s, "wait_s": wait_s}


def _import_judges():
    """Import what judges the dumps (diagnose.hang_judge: the verdict, the flight recorder's
    reader, the dumps' own types) and the doctor channel while the first dumps run rather than
    before them: that import and the py-spy processes overlap. The switch interval is shortened
    meanwhile: a dump thread whose py-spy finished waits for the GIL no longer than that before
    it reads the output and starts the next one. Returns the channel module."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, 0.0005))
    try:
        _judges()
        from areal_cli.worker import channel
    finally:
        sys.setswitchinterval(interval)
    return channel


def _judges():
    """diagnose.hang_judge. Imported here, on first use, not at the top: this module is on the
    way to the first dump, and that one is imported while the dumps run (_import_judges)."""
    from areal_cli.diagnose import hang_judge

    return hang_judge


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
