"""A node of a running Slurm job dies, on a cluster of the test's own: first its slurmd only (the
doctor cannot reach the node: it names it and judges from the other), then the node itself
(`areal train` names the node and the ranks that ran there)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import psutil

from areal_cli.registry import open_registry
from tests.helpers import AREAL, areal

HANG = str(Path(__file__).with_name("slurm_hang.py"))


def test_a_node_that_dies_is_named_by_the_doctor_and_by_the_root_cause(
    private_slurm_cluster, areal_env
):
    cluster = private_slurm_cluster
    home, registry = areal_env
    env = {**os.environ, **cluster.env}
    proc = subprocess.Popen(
        [AREAL, "train", "--scheduler", "slurm", "--alloc", "fsdp:d2", "--gpus-per-node", "1",
         "--servers", "none", HANG],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        reg = open_registry(registry)
        deadline = time.monotonic() + 240
        while len(reg.ranks("default", "trial0")) < 2:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the ranks did not register"
            time.sleep(0.2)
        nodes = {r.rank: r.node for r in reg.ranks("default", "trial0")}
        assert sorted(nodes.values()) == ["n1", "n2"]
        # The node of rank 1 (the rank that skips the all_reduce) dies; rank 0 lives on `other`.
        dying, other = nodes[1], nodes[0]

        # Its slurmd dies first: its ranks still run, but no step reaches the node any more.
        pidfile = cluster.state_dir / "run" / f"slurmd-{dying}.pid"
        psutil.Process(int(pidfile.read_text())).kill()
        res = areal("doctor", "hang", "--job", "default/trial0", "--json", env=cluster.env,
                    timeout=180)  # fmt: skip
        report = json.loads(res.stdout)
        assert res.returncode == 1, res.stderr  # a node could not be read
        unreachable = [e for e in report["errors"] if e["kind"] == "unreachable"]
        assert unreachable and all(dying in e["error"] for e in unreachable)
        by_rank = {r["rank"]: r for r in report["ranks"]}
        assert by_rank[0]["state"] == "collective" and by_rank[0]["node"] == other
        assert by_rank[1]["state"] == "error" and by_rank[1]["node"] == dying
        assert report["verdict"] is not None
        assert dying in res.stderr

        # Then the node itself: the job fails, the root cause names the node and its rank.
        cluster.kill_node(dying)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, err[-3000:]
        assert f"node {dying} (rank 1) failed (Slurm: NODE_FAIL)" in err, err[-3000:]
        assert "Traceback" not in err.split("error:")[-1]
        assert reg.ranks("default", "trial0", include_dead=True) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            areal("stop", "default/trial0", env=cluster.env, timeout=60)
