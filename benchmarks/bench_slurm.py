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

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import ROOT, doctor_vs_local, serve_ready

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


def main() -> int:
    from areal_cli.modelgen import create_tiny_model

    started = cluster_up()
    ok = True
    try:
        with tempfile.TemporaryDirectory(prefix="bench-slurm-") as tmp:
            env = {**os.environ, "SLURM_CONF": str(STATE / "slurm.conf"),
                   "AREAL_HOME": f"{tmp}/home", "AREAL_REGISTRY": f"{tmp}/reg"}  # fmt: skip
            model = create_tiny_model(Path(tmp) / "tiny")
            ok &= serve_ready(env, model, "slurm", "2 nodes")
            ok &= doctor_vs_local(env, "slurm", 8, ["--gpus-per-node", "4"], "2 nodes x 4 ranks")
    finally:
        if started:
            cluster_down()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
