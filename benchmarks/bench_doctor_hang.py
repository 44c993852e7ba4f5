"""`areal doctor hang` on real ranks against what people do by hand: a shell loop of `py-spy dump`.

torchrun starts N gloo ranks of tests/scenarios/skip_allreduce.py: every rank imports torch, the
last one skips an all_reduce and the others wait in it. In one run, interleaved, best of a few:

    doctor   areal doctor hang --pid <torchrun pid> --json --samples 1   (one dump per rank)
    loop     for p in <rank pids>; do py-spy dump --pid $p; done
    default  areal doctor hang --pid <torchrun pid> --json               (3 samples over ~1 s)

    doctor_hang_vs_pyspy_loop[16]: 0.93      (lower is better; target <= 1.0)
    doctor_hang_vs_pyspy_loop[64]: 0.58      (target <= 0.6)

The ratio compares the same work (one dump of every rank, and the doctor also judges). The
default run waits between its samples on purpose; its time is printed beside, split like the
doctor's: start-up (interpreter, imports, output), finding the ranks, dumping (with the
permission check beside it), waiting, asking the flight recorders, judging. The load average
is printed before and after each size: on a shared host it decides more than the code does.
64 ranks need about 64 x 170 MB: the run is skipped, and says so, when the host has not that
much memory available.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil

from areal_cli import procs
from areal_cli.diagnose import stacks

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "tests" / "scenarios" / "skip_allreduce.py"
AREAL = str(Path(sys.executable).parent / "areal")
TARGETS = {16: 1.0, 64: 0.6}
REPEATS = {16: 15, 64: 10}  # others: 3; the minimum of many sees through a busy host
RANK_MB = 250  # one rank with torch imported and gloo up: about 170 MB here, with room to spare


def available_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    return 0


def start_job(n: int, workdir: Path, marker: str) -> subprocess.Popen:
    env = {
        **os.environ,
        procs.MARKER_ENV: marker,
        "SCENARIO_DIR": str(workdir),
        "SCENARIO_LIFETIME": "900",  # the ranks end themselves even if this run is killed
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    port = procs.free_ports(1, start=29600)[0]
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={n}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        str(SCENARIO),
    ]
    log = open(workdir / "torchrun.log", "wb")
    proc = procs.spawn(argv, env=env, cwd=workdir, stdout=log)
    log.close()

    def ready() -> bool:
        if proc.poll() is not None:
            tail = (workdir / "torchrun.log").read_text()[-2000:]
            raise RuntimeError(f"torchrun exited {proc.returncode}:\n{tail}")
        return sum(1 for _ in workdir.glob("ready-*")) == n

    if not procs.wait_until(ready, 60 + 4 * n, cap=0.5):
        raise RuntimeError(f"{n} ranks did not get ready within {60 + 4 * n}s")
    return proc


# As installed: bytecode cached (the warm-up run writes it), not compiled on every call.
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def settle(torchrun: int, quiet: float = 0.3, limit: float = 60.0) -> None:
    """Wait until the ranks have settled into the hang (less than `quiet` of a core between
    them; gloo's own threads keep a little): right after start-up they still connect."""
    ranks = psutil.Process(torchrun).children()

    def cpu() -> float:
        total = 0.0
        for r in ranks:
            try:
                total += sum(r.cpu_times()[:2])
            except psutil.Error:
                pass
        return total

    deadline = time.monotonic() + limit
    before = cpu()
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = cpu()
        if now - before < quiet:
            return
        before = now


def timed(argv: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True, env=ENV)
    elapsed = time.perf_counter() - start
    if res.returncode != 0:
        raise RuntimeError(f"{argv[:3]} failed ({res.returncode}): {res.stderr[-800:]}")
    return elapsed, res.stdout


def phases(wall: float, out: str, n: int) -> dict[str, float]:
    data = json.loads(out)
    v = data["verdict"]
    if v["kind"] != "mismatched_collective" or v["odd_ranks"] != [n - 1]:
        raise RuntimeError(f"wrong verdict at {n} ranks: {v['kind']} {v['odd_ranks']}")
    t = data["timing"]
    return {
        "wall": wall,
        "start-up": wall - data["elapsed_s"] - t["find_s"],
        "find": t["find_s"],
        "preflight": t["preflight_s"],
        "dump": t["dump_s"],
        "wait": t["wait_s"],
        "flight": t.get("flight_s", 0.0),
        "judge": t["judge_s"],
    }


def split(p: dict[str, float]) -> str:
    # The permission check runs beside the first dumps: it is inside `dump`, shown apart.
    parts = ["start-up", "find", "dump", "wait", "flight", "judge"]
    return (
        f"{p['wall'] * 1000:.0f} ms = "
        + " + ".join(f"{k} {p[k] * 1000:.0f}" for k in parts if k != "wait" or p[k] > 0)
        + f" (preflight {p['preflight'] * 1000:.0f} of the dump's time)"
    )


def measure(n: int, pyspy: str) -> float | None:
    need = n * RANK_MB + 1024
    if available_mb() < need:
        print(
            f"  ranks={n}: skipped, {available_mb()} MB available, {need} MB needed",
            file=sys.stderr,
        )
        return None
    marker = f"bench-doctor-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="bench-doctor-") as tmp:
        proc = None
        try:
            proc = start_job(n, Path(tmp), marker)
            settle(proc.pid)
            pids = [c.pid for c in psutil.Process(proc.pid).children() if "RANK" in c.environ()]
            doctor = [AREAL, "doctor", "hang", "--pid", str(proc.pid), "--json"]
            loop = (
                f"for p in {' '.join(map(str, pids))}; do "
                f"{shlex.quote(pyspy)} dump --pid $p > /dev/null || exit 1; done"
            )
            timed([*doctor, "--samples", "1"])  # warm-up: bytecode and page cache
            one, loops, default = [], [], []
            for _ in range(REPEATS.get(n, 3)):  # interleaved: all three see the same machine load
                wall, out = timed([*doctor, "--samples", "1"])
                one.append(phases(wall, out, n))
                loops.append(timed(["bash", "-c", loop])[0])
                wall, out = timed(doctor)
                default.append(phases(wall, out, n))
            best = min(one, key=lambda p: p["wall"])
            best_default = min(default, key=lambda p: p["wall"])
            print(f"  ranks={n}: doctor --samples 1 {split(best)}", file=sys.stderr)
            print(f"  ranks={n}: py-spy loop {min(loops) * 1000:.0f} ms", file=sys.stderr)
            print(f"  ranks={n}: doctor (default) {split(best_default)}", file=sys.stderr)
            return best["wall"] / min(loops)
        finally:
            if proc is not None:
                procs.kill_job(marker, [proc.pid], grace=3.0)
                proc.wait(timeout=30)


def main() -> int:
    pyspy = stacks.require_pyspy()
    print(f"  py-spy processes at once: {stacks.default_workers()}", file=sys.stderr)
    print(f"  load average: {Path('/proc/loadavg').read_text().strip()}", file=sys.stderr)
    sizes = [int(a) for a in sys.argv[1:]] or list(TARGETS)  # e.g. `bench_doctor_hang.py 16`
    for n in sizes:
        target = TARGETS.get(n, 1.0)
        ratio = measure(n, pyspy)
        if ratio is None:
            print(f"doctor_hang_vs_pyspy_loop[{n}]: skipped (memory)")
            continue
        mark = "ok" if ratio <= target else "MISSED"
        print(f"doctor_hang_vs_pyspy_loop[{n}]: {ratio:.2f}   (target <= {target}, {mark})")
        print(f"  load average: {Path('/proc/loadavg').read_text().strip()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
