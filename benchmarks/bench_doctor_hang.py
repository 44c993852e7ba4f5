"""`areal doctor hang` against what people do by hand: a shell loop of `py-spy dump`.

Both are whole commands timed from outside, in the same run, over the same rank processes
(plain Python processes with RANK/WORLD_SIZE in their environment, blocked in a queue read,
which is all py-spy and the doctor look at). The doctor dumps every rank at once and judges;
the loop dumps one after another and leaves the judging to the reader.

    doctor_hang_vs_pyspy_loop[16]: 0.31      (lower is better; target <= 0.5 at 16 ranks)

Prints the ratio for 4, 16 and 32 ranks; the ratio falls as ranks grow because the loop's cost
grows with every rank while the doctor's is mostly paid once.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from areal_cli import procs
from areal_cli.diagnose import hang, stacks, targets

RANK_SOURCE = """
import os, queue, pathlib
def next_batch(q):
    return q.get()
def train_step():
    pathlib.Path(os.environ["BENCH_READY"]).touch()
    next_batch(queue.Queue())
train_step()
"""

REPEATS = 5


def start_ranks(n: int, workdir: Path, marker: str) -> list[subprocess.Popen]:
    ps = []
    for r in range(n):
        env = {
            **os.environ,
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "WORLD_SIZE": str(n),
            "LOCAL_WORLD_SIZE": str(n),
            "BENCH_READY": str(workdir / f"ready-{r}"),
            procs.MARKER_ENV: marker,
        }
        ps.append(
            procs.spawn([sys.executable, "-c", RANK_SOURCE], env=env, stdout=subprocess.DEVNULL)
        )
    ok = procs.wait_until(lambda: all((workdir / f"ready-{r}").exists() for r in range(n)), 60)
    if not ok:
        raise RuntimeError("rank processes did not start")
    return ps


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    res = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    if res.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({res.returncode}): {res.stderr[-500:]}")
    return elapsed


def measure(n: int, areal: str, pyspy: str) -> tuple[float, float]:
    marker = f"bench-doctor-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="bench-doctor-") as tmp:
        ranks = start_ranks(n, Path(tmp), marker)
        try:
            pids = [p.pid for p in ranks]
            doctor = [areal, "doctor", "hang", "--json"] + [
                a for p in pids for a in ("--pid", str(p))
            ]
            loop = (
                f"for p in {' '.join(map(str, pids))}; do "
                f"{shlex.quote(pyspy)} dump --pid $p > /dev/null || exit 1; done"
            )
            # Interleaved, best of REPEATS: both see the same machine load.
            d_times, l_times, lib_times = [], [], []
            jobs = targets.resolve(pids=pids)
            for _ in range(REPEATS):
                d_times.append(timed(doctor))
                l_times.append(timed(["bash", "-c", loop]))
                start = time.perf_counter()
                hang.diagnose(jobs)
                lib_times.append(time.perf_counter() - start)
            # Context for the reader: the dumping and judging alone, without the CLI's start-up.
            print(
                f"  ranks={n}: dump+verdict in-process {min(lib_times) * 1000:.0f} ms",
                file=sys.stderr,
            )
            return min(d_times), min(l_times)
        finally:
            procs.kill_job(marker, [p.pid for p in ranks], grace=1.0)


def main() -> int:
    areal = str(Path(sys.executable).parent / "areal")
    pyspy = stacks.require_pyspy()
    ratios = {}
    for n in (4, 16, 32):
        d, loop = measure(n, areal, pyspy)
        ratios[n] = d / loop
        print(
            f"  ranks={n}: doctor {d * 1000:.0f} ms, py-spy loop {loop * 1000:.0f} ms",
            file=sys.stderr,
        )
        print(f"doctor_hang_vs_pyspy_loop[{n}]: {ratios[n]:.2f}")
    falling = ratios[4] > ratios[16] > ratios[32]
    print(f"doctor_hang_ratio_falls_with_ranks: {'yes' if falling else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
