"""Shared timing helpers: medians of whole-command wall times, measured in one run; what the
cluster schedulers' benchmarks (bench_slurm, bench_ray) measure the same way."""

from __future__ import annotations

import http.client
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent
AREAL = str(BIN / "areal")


def wall(argv: list[str], repeat: int = 5, **kw) -> float:
    """Median wall time of a whole command, in seconds."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, **kw)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def report(name: str, value: float, target: str, ok: bool) -> bool:
    mark = "ok" if ok else "MISSED"
    print(f"{name}: {value:.3f}   (target {target}, {mark})", flush=True)
    return ok


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int, path: str = "/health", timeout: float = 10.0) -> bool:
    """The server on this port answers `path` with 200 (polled by the readiness figures)."""
    try:
        # SGLang's /health takes a second and more (a generation, then a 1 s sleep): a shorter
        # timeout would give up on the answer it waits for.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status == 200
    except (OSError, http.client.HTTPException):
        return False


# -------------------------------------------------- cluster schedulers (bench_slurm, bench_ray)

ROOT = Path(__file__).resolve().parents[1]
# Both hung jobs run it: the last rank skips an all_reduce, the others wait in it.
HANG = str(ROOT / "tests" / "integration" / "slurm_hang.py")


def loadavg() -> str:
    """The 1-minute load average, printed beside a figure: a busy host misses targets."""
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def run(argv: list[str], env: dict, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    if check and res.returncode != 0:
        sys.exit(f"{' '.join(argv[:4])} failed ({res.returncode}):\n{res.stderr[-2000:]}")
    return res


def serve_overhead(env: dict, model: Path, scheduler: str) -> tuple[float, float, float]:
    """(wall to ready, the servers' own time to healthy, the difference) of one detached
    `areal serve --scheduler S --alloc hf:d2`: the servers' own time is each one's start to
    its registration, from the registry's metadata of the same run."""
    from areal_cli.registry import open_registry

    t0 = time.time()
    run([AREAL, "serve", "--scheduler", scheduler, "--backend", "hf", "--alloc", "hf:d2",
         "--model", str(model), "--trial", "bench", "--detach"], env)  # fmt: skip
    wall = time.time() - t0
    entries = open_registry(env["AREAL_REGISTRY"]).list("default", "bench").servers
    if len(entries) != 2:
        sys.exit(f"expected 2 registered servers, found {len(entries)}")
    own = max(e.started - e.pid_create_time for e in entries)
    run([AREAL, "stop", "default/bench"], env)
    return wall, own, wall - own


def serve_ready(env: dict, model: Path, scheduler: str, where: str) -> bool:
    """`<scheduler>_serve_ready_overhead_s`: medians of 3 after a warm-up (page cache,
    bytecode, the cluster's worker pools). Target <= 1.5 s."""
    serve_overhead(env, model, scheduler)
    runs = [serve_overhead(env, model, scheduler) for _ in range(3)]
    wall, own, over = (statistics.median(x) for x in zip(*runs, strict=True))
    print(f"  serve hf:d2 on {where}: {wall:.2f} s to ready, the servers' own {own:.2f} s "
          f"(medians of {len(runs)}; load average {loadavg()})")  # fmt: skip
    return report(f"{scheduler}_serve_ready_overhead_s", over, "<= 1.5", over <= 1.5)


def start_hung(env: dict, trial: str, world: int, extra: list[str]) -> subprocess.Popen:
    argv = [AREAL, "train", "--alloc", f"fsdp:d{world}", "--trial", trial, "--servers", "none"]
    return subprocess.Popen([*argv, *extra, HANG], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def wait_ranks(env: dict, trials: list[str], procs: list[subprocess.Popen], world: int) -> None:
    from areal_cli.registry import open_registry

    reg = open_registry(env["AREAL_REGISTRY"])
    deadline = time.monotonic() + 600
    while not all(len(reg.ranks("default", t)) == world for t in trials):
        for p in procs:
            if p.poll() is not None:
                sys.exit(f"a hung job ended early:\n{p.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            sys.exit(f"the hung jobs did not register {world} ranks each in 10 minutes")
        time.sleep(0.5)
    time.sleep(3)  # past start-up: the ranks sit in the hang


def doctor(env: dict, trial: str, odd: int) -> tuple[float, dict]:
    """Wall time and report of `areal doctor hang --job default/TRIAL --json`, whose verdict
    must name rank `odd`."""
    t0 = time.perf_counter()
    res = run([AREAL, "doctor", "hang", "--job", f"default/{trial}", "--json"], env)
    wall = time.perf_counter() - t0
    out = json.loads(res.stdout)
    v = out["verdict"]
    if v["kind"] != "mismatched_collective" or v["odd_ranks"] != [odd]:
        sys.exit(f"wrong verdict on {trial}: {v['kind']} {v['odd_ranks']}")
    return wall, out


def doctor_vs_local(
    env: dict, scheduler: str, world: int, extra: list[str], where: str,
    nodes: set[str] | None = None, repeat: int = 5,
) -> bool:  # fmt: skip
    """`<scheduler>_doctor_hang_vs_local`: doctor hang on a hung job of `world` ranks on the
    cluster over the same on `world` local ranks, both jobs up at once, runs interleaved (both
    see the same load), best of each. `nodes`: the nodes whose ranks the report must name.
    Target <= 2."""
    procs = [start_hung(env, "local", world, []),
             start_hung(env, scheduler, world, ["--scheduler", scheduler, *extra])]  # fmt: skip
    local: list[float] = []
    remote: list[float] = []
    try:
        wait_ranks(env, ["local", scheduler], procs, world)
        doctor(env, "local", world - 1), doctor(env, scheduler, world - 1)  # warm-up
        loads = []
        for _ in range(repeat):
            local.append(doctor(env, "local", world - 1)[0])
            wall_, out = doctor(env, scheduler, world - 1)
            seen = {r.get("node") for r in out.get("ranks", [])}
            if nodes is not None and seen != nodes:
                sys.exit(f"the {scheduler} job's ranks were not read on every node: {seen}")
            remote.append(wall_)
            loads.append(loadavg())
    finally:
        for trial in ("local", scheduler):
            run([AREAL, "stop", f"default/{trial}"], env, check=False)
        for p in procs:
            p.wait(timeout=120)
    print(f"  doctor hang: {world} local ranks {min(local):.2f} s, {where} {min(remote):.2f} s "
          f"(best of {len(local)}; load averages {', '.join(loads)})")  # fmt: skip
    ratio = min(remote) / min(local)
    return report(f"{scheduler}_doctor_hang_vs_local", ratio, "<= 2", ratio <= 2)
