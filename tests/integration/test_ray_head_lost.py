"""The head of a Ray cluster dies under a serving job (a cluster of its own: the session's
keeps its head). `areal stop` cannot reach Ray (exit 3, as it must: the job's nodes
elsewhere and its actors are not known to be gone), yet the job's servers on this host need
no Ray to be found: they carry the job's marker, and are ended by it, and the output says so.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers import FAKE_PYTHON, areal
from tests.integration.test_ray import marked


@pytest.fixture
def own_cluster(monkeypatch):
    import ray_cluster as rc

    reason = rc.ray_missing()
    if reason:
        pytest.skip(reason)
    cluster = rc.start_ray_cluster()
    try:
        for key, value in cluster.env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
        yield cluster
    finally:
        rc.stop_ray_cluster(cluster)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from areal_cli.modelgen import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=0)


def test_stop_with_the_head_gone_ends_the_jobs_servers_on_this_host(own_cluster, tiny,
                                                                    areal_env, monkeypatch):  # fmt: skip
    import ray_cluster as rc

    from areal_cli import procs

    # Three one-CPU replicas on two-CPU nodes: at least one runs on the worker node, whose
    # processes outlive the head.
    res = areal("serve", "--scheduler", "ray", "--backend", "hf", "--model", str(tiny),
                "--alloc", "hf:d3", "--python", FAKE_PYTHON, "--detach", "--json",
                check=0, timeout=300)  # fmt: skip
    out = json.loads(res.stdout)
    marker = out["marker"]
    try:
        on_worker = [s for s in out["servers"] if s["node"] == rc.WORKER_IP]
        assert on_worker, out["servers"]
        rc.kill_node(own_cluster, rc.HEAD_IP)
        left = marked(marker)
        assert {s["pid"] for s in on_worker} <= {p.pid for p in left}
        monkeypatch.setenv("AREAL_RAY_TIMEOUT", "5")
        stop = areal("stop", "default/trial0", check=3, timeout=180)
        assert "did not answer within 5s" in stop.stderr
        said = re.search(r"(\d+) process\(es\) of default/trial0 on this host ended by its "
                         r"marker", stop.stderr)  # fmt: skip
        assert said and int(said[1]) >= len(on_worker), stop.stderr
        assert "Traceback" not in stop.stderr
        assert marked(marker) == []
        # Again: nothing of it is left here to end, and it says that.
        again = areal("stop", "default/trial0", check=3, timeout=180)
        assert "no process of default/trial0 runs on this host" in again.stderr
    finally:
        procs.kill_job(marker, grace=1.0)
