"""`--scheduler slurm` on the local two-node test cluster (scripts/local-slurm.sh; started here
when none is up, stopped after).

    slurm_serve_ready_overhead_s   `areal serve --scheduler slurm --alloc hf:d2 --detach`, its
                                   wall time minus the servers' own time to healthy (each
                                   server's start to its registration, from the registry's
                                   metadata of the same run): sbatch, scheduling, the job steps,
                                   the runners, the wait. Target <= 1.5 s.
    slurm_doctor_hang_vs_local     `areal doctor hang --job` on a hung job of 2 nodes x 4 ranks
                                   (one srun --overlap per node) over the same on 8 local ranks,
                                   both jobs up at once, runs interleaved, best of each.
                                   Target <= 2.

Both hung jobs run tests/integration/slurm_hang.py (the last rank skips an all_reduce).
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
LOCAL_SLURM = ROOT / "scripts" / "local-slurm.sh"
STATE = Path(os.environ.get("AREAL_SLURM_STATE") or "/tmp/areal-slurm")
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def cluster_up() -> bool:
    """Bring the test cluster up if it is not; True when this run started it."""
    env = {"PATH": SYSTEM_PATH, "HOME": os.environ.get("HOME", "/root")}
    status = subprocess.run(["bash", str(LOCAL_SLURM), "status", str(STATE)], env=env,
                            capture_output=True, text=True)  # fmt: skip
    if status.returncode == 0:
        return False
    subprocess.run(["bash", str(LOCAL_SLURM), "up", str(STATE)], env=env, check=True,
                   capture_output=True)  # fmt: skip
    return True


def cluster_down() -> None:
    env = {"PATH": SYSTEM_PATH, "HOME": os.environ.get("HOME", "/root")}
    subprocess.run(["bash", str(LOCAL_SLURM), "down", str(STATE)], env=env, capture_output=True)


def run(argv: list[str], env: dict, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    if check and res.returncode != 0:
        sys.exit(f"{' '.join(argv[:4])} failed ({res.returncode}):\n{res.stderr[-2000:]}")
    return res


# -------------------------------------------------------------------------------- serve


def serve_overhead(env: dict, model: Path) -> tuple[float, float, float]:
    """(wall to ready, the servers' own time to healthy, the difference) of one detached serve."""
    from areal_cli.registry import open_registry

    t0 = time.time()
    run([AREAL, "serve", "--scheduler", "slurm", "--backend", "hf", "--alloc", "hf:d2",
         "--model", str(model), "--trial", "bench", "--detach"], env)  # fmt: skip
    wall = time.time() - t0
    entries = open_registry(env["AREAL_REGISTRY"]).list("default", "bench").servers
    if len(entries) != 2:
        sys.exit(f"expected 2 registered servers, found {len(entries)}")
    own = max(e.started - e.pid_create_time for e in entries)
    run([AREAL, "stop", "default/bench"], env)
    return wall, own, wall - own


# -------------------------------------------------------------------------------- doctor


def start_hung(env: dict, trial: str, slurm: bool) -> subprocess.Popen:
    argv = [AREAL, "train", "--alloc", "fsdp:d8", "--trial", trial, "--servers", "none"]
    if slurm:
        argv += ["--scheduler", "slurm", "--gpus-per-node", "4"]
    return subprocess.Popen([*argv, HANG], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def wait_ranks(env: dict, trials: list[str], procs: list[subprocess.Popen]) -> None:
    from areal_cli.registry import open_registry

    reg = open_registry(env["AREAL_REGISTRY"])
    deadline = time.monotonic() + 600
    while not all(len(reg.ranks("default", t)) == 8 for t in trials):
        for p in procs:
            if p.poll() is not None:
                sys.exit(f"a hung job ended early:\n{p.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            sys.exit("the hung jobs did not register 8 ranks each in 10 minutes")
        time.sleep(0.5)
    time.sleep(3)  # past start-up: the ranks sit in the hang


def doctor(env: dict, trial: str) -> float:
    t0 = time.perf_counter()
    res = run([AREAL, "doctor", "hang", "--job", f"default/{trial}", "--json"], env)
    wall = time.perf_counter() - t0
    v = json.loads(res.stdout)["verdict"]
    if v["kind"] != "mismatched_collective" or v["odd_ranks"] != [7]:
        sys.exit(f"wrong verdict on {trial}: {v['kind']} {v['odd_ranks']}")
    return wall


def main() -> int:
    from areal_cli.modelgen import create_tiny_model

    started = cluster_up()
    ok = True
    try:
        with tempfile.TemporaryDirectory(prefix="bench-slurm-") as tmp:
            env = {**os.environ, "SLURM_CONF": str(STATE / "slurm.conf"),
                   "AREAL_HOME": f"{tmp}/home", "AREAL_REGISTRY": f"{tmp}/reg"}  # fmt: skip
            model = create_tiny_model(Path(tmp) / "tiny")
            serve_overhead(env, model)  # warm-up: page cache, bytecode
            runs = [serve_overhead(env, model) for _ in range(3)]
            wall, own, over = (statistics.median(x) for x in zip(*runs, strict=True))
            print(f"  serve hf:d2 on 2 nodes: {wall:.2f} s to ready, the servers' own "
                  f"{own:.2f} s (medians of {len(runs)})")  # fmt: skip
            ok &= report("slurm_serve_ready_overhead_s", over, "<= 1.5", over <= 1.5)

            procs = [start_hung(env, "local", False), start_hung(env, "slurm", True)]
            try:
                wait_ranks(env, ["local", "slurm"], procs)
                doctor(env, "local"), doctor(env, "slurm")  # warm-up
                local, slurm = [], []
                for _ in range(5):  # interleaved: both see the same machine load
                    local.append(doctor(env, "local"))
                    slurm.append(doctor(env, "slurm"))
            finally:
                for trial in ("local", "slurm"):
                    run([AREAL, "stop", f"default/{trial}"], env, check=False)
                for p in procs:
                    p.wait(timeout=60)
            print(f"  doctor hang: 8 local ranks {min(local):.2f} s, 2 nodes x 4 ranks "
                  f"{min(slurm):.2f} s (best of {len(local)})")  # fmt: skip
            ratio = min(slurm) / min(local)
            ok &= report("slurm_doctor_hang_vs_local", ratio, "<= 2", ratio <= 2)
    finally:
        if started:
            cluster_down()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
