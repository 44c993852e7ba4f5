"""A Ray node dying under a running job, on the real two-node cluster: every process of the
worker node (its raylet, its Ray workers, the job's runner, torchrun and ranks there) is
killed at once, as a crashed host would take them. `areal ps` says the job was killed from
Ray's side and why (Ray's words: the node died), and `areal stop` leaves no actor, placement
group, process or registry entry. The node is started again afterwards for the tests that
follow."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.helpers import AREAL, REPO, areal
from tests.integration.test_ray import marked, ray_left

pytestmark = pytest.mark.usefixtures("ray_env")

HANG = str(REPO / "tests" / "integration" / "slurm_hang.py")


def test_a_node_dying_under_a_job_shows_in_ps_and_stop_leaves_nothing(ray_env, areal_env):
    import ray_cluster as rc

    from areal_cli.registry import open_registry

    home, reg_path = areal_env
    reg = open_registry(str(reg_path))
    proc = subprocess.Popen(
        [AREAL, "train", "--scheduler", "ray", "--alloc", "fsdp:d2", "--nnodes", "2",
         "--servers", "none", HANG],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    restarted = False
    try:
        deadline = time.monotonic() + 240
        while len(reg.ranks("default", "trial0")) < 2:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the ranks did not register"
            time.sleep(0.5)
        ranks = reg.ranks("default", "trial0")
        marker = ranks[0].marker
        assert {r.node for r in ranks} == set(ray_env.nodes)
        # Nobody watches: `areal ps` alone finds out.
        proc.kill()
        proc.wait()
        on_worker = [r.pid for r in ranks if r.node == rc.WORKER_IP]
        assert rc.kill_node(ray_env, rc.WORKER_IP) > 3
        assert not [p for p in marked(marker) if p.pid in on_worker]

        deadline = time.monotonic() + 90  # Ray declares a node dead after its health checks
        while True:
            (job,) = [j for j in json.loads(areal("ps", "--json", "--all").stdout)
                      if j["scheduler"] == "ray"]  # fmt: skip
            if job["state"] != "running" or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        assert job["state"] == "killed", job
        assert job["message"].startswith("killed from Ray's side: torchrun-"), job["message"]
        # Ray's words, on one line, with the node that died named by its address.
        assert "because its node has died" in job["message"], job["message"]
        assert f"(node {rc.WORKER_IP})" in job["message"] and "\\n" not in job["message"]
        text = areal("ps", "--all").stdout
        assert "killed" in text and "killed from Ray's side" in text

        stop = areal("stop", "default/trial0", check=0, timeout=120)
        assert stop.returncode == 0, stop.stderr
        assert "Traceback" not in stop.stderr
        assert marked(marker) == []
        left = ray_left(ray_env)
        assert not [a for a in left["actors"] if a.startswith(marker)]
        assert not [g for g in left["groups"] if g.startswith(marker)]
        assert reg.ranks("default", "trial0") == [] and reg.list("default", "trial0").servers == []
        rc.restart_worker(ray_env, rc.WORKER_IP)
        restarted = True
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        areal("stop", "default/trial0", check=0, timeout=120)
        if not restarted and not rc.node_processes(ray_env, rc.WORKER_IP):
            rc.restart_worker(ray_env, rc.WORKER_IP)
