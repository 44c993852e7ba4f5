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

import os
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, doctor_vs_local, serve_ready

sys.path.insert(0, str(ROOT / "tests"))


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
            ok &= serve_ready(env, model, "ray", "2 Ray nodes")
            ok &= doctor_vs_local(env, "ray", 4, ["--nnodes", "2"], "2 Ray nodes x 2 ranks",
                                  nodes=set(cluster.nodes))  # fmt: skip
    finally:
        rc.stop_ray_cluster(cluster)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
