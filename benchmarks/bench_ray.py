"""`--scheduler ray` on a local two-node Ray cluster (tests/ray_cluster.py: head 127.0.0.2,
worker 127.0.0.3, token auth; started here, stopped after; AREAL_RAY_CLUSTER reuses one).

    ray_serve_ready_overhead_s   `areal serve --scheduler ray --alloc hf:d2 --detach`, its
                                 wall time minus the servers' own time to healthy (each
                                 server's start to its registration, from the registry's
                                 metadata of the same run): connecting, placing the actors,
                                 the runners, the wait. Target <= 1.5 s.
    ray_doctor_hang_vs_local     `areal doctor hang --job` on a hung job of 2 Ray nodes x 2
                                 ranks (sampled through the job's actor on each node) over
                                 the same on 4 local ranks, both jobs up at once, runs
                                 interleaved, best of each. Target <= 2.

Both hung jobs run tests/integration/slurm_hang.py (the last rank skips an all_reduce).
Needs Ray (pip install 'areal-cli[ray]').
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import AREAL, report

ROOT = Path(__file__).resolve().parents[1]
HANG = str(ROOT / "tests" / "integration" / "slurm_hang.py")
sys.path.insert(0, str(ROOT / "tests"))


def run(argv: list[str], env: dict, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    if check and res.returncode != 0:
        sys.exit(f"{' '.join(argv[:4])} failed ({res.returncode}):\n{res.stderr[-2000:]}")
    return res


def serve_overhead(env: dict, model: Path) -> tuple[float, float, float]:
    from areal_cli.registry import open_registry

    t0 = time.time()
    run([AREAL, "serve", "--scheduler", "ray", "--backend", "hf", "--alloc", "hf:d2",
         "--model", str(model), "--trial", "bench", "--detach"], env)  # fmt: skip
    wall = time.time() - t0
    entries = open_registry(env["AREAL_REGISTRY"]).list("default", "bench").servers
    if len(entries) != 2:
        sys.exit(f"expected 2 registered servers, found {len(entries)}")
    own = max(e.started - e.pid_create_time for e in entries)
    run([AREAL, "stop", "default/bench"], env)
    return wall, own, wall - own


def start_hung(env: dict, trial: str, ray: bool) -> subprocess.Popen:
    argv = [AREAL, "train", "--alloc", "fsdp:d4", "--trial", trial, "--servers", "none"]
    if ray:
        argv += ["--scheduler", "ray", "--nnodes", "2"]
    return subprocess.Popen([*argv, HANG], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def wait_ranks(env: dict, trials: list[str], procs: list[subprocess.Popen]) -> None:
    from areal_cli.registry import open_registry

    reg = open_registry(env["AREAL_REGISTRY"])
    deadline = time.monotonic() + 600
    while not all(len(reg.ranks("default", t)) == 4 for t in trials):
        for p in procs:
            if p.poll() is not None:
                sys.exit(f"a hung job ended early:\n{p.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            sys.exit("the hung jobs did not register 4 ranks each in 10 minutes")
        time.sleep(0.5)
    time.sleep(3)  # past start-up: the ranks sit in the hang


def doctor(env: dict, trial: str) -> tuple[float, dict]:
    t0 = time.perf_counter()
    res = run([AREAL, "doctor", "hang", "--job", f"default/{trial}", "--json"], env)
    wall = time.perf_counter() - t0
    out = json.loads(res.stdout)
    v = out["verdict"]
    if v["kind"] != "mismatched_collective" or v["odd_ranks"] != [3]:
        sys.exit(f"wrong verdict on {trial}: {v['kind']} {v['odd_ranks']}")
    return wall, out


def main() -> int:
    import ray_cluster as rc

    from areal_cli.modelgen import create_tiny_model

    if rc.ray_missing():
        sys.exit(rc.ray_missing())
    t0 = time.monotonic()
    cluster = rc.start_ray_cluster()
    print(f"  Ray cluster of 2 nodes up in {time.monotonic() - t0:.1f} s")
    ok = True
    try:
        with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
            env = {**os.environ, **cluster.env, "AREAL_HOME": f"{tmp}/home",
                   "AREAL_REGISTRY": f"{tmp}/reg"}  # fmt: skip
            env.pop("RAY_AUTH_TOKEN", None)
            model = create_tiny_model(Path(tmp) / "tiny")
            serve_overhead(env, model)  # warm-up: page cache, bytecode, Ray's worker pool
            runs = [serve_overhead(env, model) for _ in range(3)]
            wall, own, over = (statistics.median(x) for x in zip(*runs, strict=True))
            print(f"  serve hf:d2 on 2 Ray nodes: {wall:.2f} s to ready, the servers' own "
                  f"{own:.2f} s (medians of {len(runs)})")  # fmt: skip
            ok &= report("ray_serve_ready_overhead_s", over, "<= 1.5", over <= 1.5)

            procs = [start_hung(env, "local", False), start_hung(env, "ray", True)]
            try:
                wait_ranks(env, ["local", "ray"], procs)
                doctor(env, "local"), doctor(env, "ray")  # warm-up
                local, ray = [], []
                for _ in range(5):  # interleaved: both see the same machine load
                    local.append(doctor(env, "local")[0])
                    wall_, out = doctor(env, "ray")
                    nodes = {r.get("node") for r in out.get("ranks", [])}
                    if nodes != set(cluster.nodes):
                        sys.exit(f"the Ray job's ranks were not read on both nodes: {nodes}")
                    ray.append(wall_)
            finally:
                for trial in ("local", "ray"):
                    run([AREAL, "stop", f"default/{trial}"], env, check=False)
                for p in procs:
                    p.wait(timeout=120)
            print(f"  doctor hang: 4 local ranks {min(local):.2f} s, 2 Ray nodes x 2 ranks "
                  f"{min(ray):.2f} s (best of {len(local)})")  # fmt: skip
            ratio = min(ray) / min(local)
            ok &= report("ray_doctor_hang_vs_local", ratio, "<= 2", ratio <= 2)
    finally:
        rc.stop_ray_cluster(cluster)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
