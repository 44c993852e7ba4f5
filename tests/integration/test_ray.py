"""`--scheduler ray` on a real two-node Ray cluster of this host (tests/ray_cluster.py: head at
127.0.0.2, a worker at 127.0.0.3, token auth on, one cluster for the session): serve, ps,
logs, stop leaving nothing on Ray or the host, training over both nodes (GRPO's reward
rising), a job killed from Ray's side, placement groups that can never or not now be placed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import psutil
import pytest

from tests.helpers import AREAL, FAKE_PYTHON, REPO, areal

TRAIN = str(REPO / "templates" / "grpo" / "train.py")
CONFIG = str(REPO / "templates" / "grpo" / "tiny_cpu.yaml")

pytestmark = pytest.mark.usefixtures("ray_env")

# Asks the cluster, from a driver of its own, what areal left on it.
_STATE = """
import json, logging, sys, ray
ray.init(address=sys.argv[1], logging_level=logging.ERROR, log_to_driver=False)
from ray._private import state
actors = [a["Name"] for a in state.actors().values()
          if a.get("State") != "DEAD" and a["Name"].startswith("areal-")]
groups = [g["name"] for g in ray.util.placement_group_table().values()
          if g["state"] != "REMOVED" and g["name"].startswith("areal-")]
print(json.dumps({"actors": actors, "groups": groups}))
"""


def ray_left(cluster) -> dict:
    res = subprocess.run([sys.executable, "-c", _STATE, cluster.address], capture_output=True,
                         text=True, timeout=60, check=True)  # fmt: skip
    return json.loads(res.stdout.strip().splitlines()[-1])


def marked(marker: str) -> list[psutil.Process]:
    from areal_cli import procs

    return procs.find_marked(marker)


def ps_json(*extra) -> list[dict]:
    return json.loads(areal("ps", "--json", *extra, check=0).stdout)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from areal_cli.modelgen import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=0)


def test_serve_on_two_nodes_ps_logs_stop_leaves_nothing(ray_cluster, tiny, areal_env):
    home, reg = areal_env
    res = areal("serve", "--scheduler", "ray", "--backend", "hf", "--model", str(tiny),
                "--alloc", "hf:d2", "--python", FAKE_PYTHON, "--detach", "--json",
                check=0, timeout=180)  # fmt: skip
    out = json.loads(res.stdout)
    servers = out["servers"]
    assert len(servers) == 2
    # Each replica binds its own node's address and registers with that node.
    for s in servers:
        host = s["addr"].rsplit(":", 1)[0]
        assert host in ray_cluster.nodes and s["node"] == host
    marker = out["marker"]
    try:
        jobs = ps_json()
        (job,) = [j for j in jobs if j["scheduler"] == "ray"]
        assert job["state"] == "running" and job["kind"] == "serve"
        assert all(s["healthy"] for s in job["servers"])
        assert set(job["nodes"]) <= set(ray_cluster.nodes)
        # A CPU actor gets no GPU: the server's environment says so (Ray sets nothing).
        for s in servers:
            env = psutil.Process(s["pid"]).environ()
            assert env["CUDA_VISIBLE_DEVICES"] == ""
            assert env["AREAL_JOB_MARKER"] == marker and env["AREAL_NODE_NAME"] == s["node"]
        logs = areal("logs", "default/trial0", "--role", "server", "-n", "5", check=0).stdout
        assert "[server-0]" in logs and "[server-1]" in logs
        left = ray_left(ray_cluster)
        assert len([a for a in left["actors"] if a.startswith(marker)]) == 2
        from areal_cli.registry import open_registry

        # Registered with the Ray job and node, as Slurm's replicas are with theirs.
        entries = open_registry(str(reg)).list("default", "trial0").servers
        assert {e.scheduler_job_id for e in entries} == {out["job_id"]}
        assert {e.scheduler for e in entries} == {"ray"} and all(e.gpus == [] for e in entries)
    finally:
        stop = areal("stop", "default/trial0", check=0, timeout=120)
    assert "Ray job" in stop.stdout
    assert marked(marker) == []  # the servers and their grandchildren
    left = ray_left(ray_cluster)
    assert not [a for a in left["actors"] if a.startswith(marker)]
    from areal_cli.registry import open_registry

    assert open_registry(str(reg)).list("default", "trial0").servers == []
    (job,) = [j for j in ps_json("--all") if j["scheduler"] == "ray"]
    assert job["state"] == "stopped"


def test_combined_grpo_learns_over_both_nodes(ray_cluster, tiny, areal_env):
    """hf:d1+fsdp:d2 over two nodes: one server actor, a placement group of two one-CPU
    bundles (STRICT_SPREAD), a torchrun on each node meeting on the first."""
    home, _ = areal_env
    steps = 12
    res = areal("train", "--scheduler", "ray", "--alloc", "hf:d1+fsdp:d2", "--nnodes", "2",
                "--model", str(tiny), TRAIN, "--config", CONFIG, f"steps={steps}",
                check=0, timeout=400)  # fmt: skip
    assert "training finished with exit code 0" in res.stderr
    logs = home / "logs" / os.environ.get("USER", "root") / "default" / "trial0"
    # One torchrun per Ray node, each named by its node.
    assert {p.name for p in logs.glob("torchrun-*.log")} == {
        f"torchrun-{n}.log" for n in ray_cluster.nodes
    }
    rows = [json.loads(x) for x in (logs / "metrics.jsonl").read_text().splitlines() if x]
    assert [r["step"] for r in rows] == list(range(steps))
    rewards = [r["reward_mean"] for r in rows]
    assert sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5 >= 0.2, rewards
    (job,) = [j for j in ps_json("--all") if j["scheduler"] == "ray"]
    assert job["state"] == "stopped" and job["kind"] == "serve+train"
    assert marked(job["marker"]) == []
    assert not [a for a in ray_left(ray_cluster)["actors"] if a.startswith(job["marker"])]
    assert not ray_left(ray_cluster)["groups"]


_KILL = """
import logging, sys, ray
ray.init(address=sys.argv[1], namespace="areal", logging_level=logging.ERROR, log_to_driver=False)
ray.kill(ray.get_actor(sys.argv[2]))
"""


def test_actor_killed_from_ray_side_shows_in_ps(ray_cluster, tiny, areal_env):
    out = json.loads(areal("serve", "--scheduler", "ray", "--backend", "hf", "--model",
                           str(tiny), "--python", FAKE_PYTHON, "--detach", "--json",
                           check=0, timeout=180).stdout)  # fmt: skip
    marker, (server,) = out["marker"], out["servers"]
    try:
        subprocess.run([sys.executable, "-c", _KILL, ray_cluster.address, f"{marker}/server-0"],
                       check=True, timeout=60)  # fmt: skip
        # Killing the actor killed its child (the replica runner), not the server below it.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            (job,) = [j for j in ps_json("--all") if j["scheduler"] == "ray"]
            if job["state"] != "running":
                break
            time.sleep(0.5)
        assert job["state"] == "killed", job
        assert "killed from Ray's side" in job["message"] and "ray.kill" in job["message"]
        # ps concluded the job: what Ray left running of it is gone, and out of discovery.
        assert (
            not psutil.pid_exists(server["pid"]) or not psutil.Process(server["pid"]).is_running()
        )
        assert marked(marker) == []
        from areal_cli.registry import open_registry

        assert open_registry(str(areal_env[1])).list("default", "trial0").servers == []
    finally:
        areal("stop", "default/trial0", check=0, timeout=120)


def test_placement_no_node_could_hold_exits_2_at_once(ray_cluster, areal_env, tmp_path):
    script = tmp_path / "t.py"
    script.write_text("print('never runs')\n")
    t0 = time.monotonic()
    # Two ranks per node at most (a node has 2 CPUs): six ranks want three nodes.
    res = areal("train", "--scheduler", "ray", "--alloc", "fsdp:d6", "--servers", "none",
                str(script), check=2, timeout=60)  # fmt: skip
    assert time.monotonic() - t0 < 30
    assert "3 node(s) with 2 CPU each (STRICT_SPREAD)" in res.stderr
    assert "127.0.0.3 (CPU 2/2 free)" in res.stderr and "Traceback" not in res.stderr
    res = areal("train", "--scheduler", "ray", "--alloc", "fsdp:d3", "--nnodes", "3",
                "--servers", "none", str(script), check=2, timeout=60)  # fmt: skip
    assert "3 node(s) with 1 CPU each (STRICT_SPREAD)" in res.stderr
    assert "has 2 such node(s)" in res.stderr


_HOLD = """
import logging, sys, time, ray
from ray.util.placement_group import placement_group
ray.init(address=sys.argv[1], logging_level=logging.ERROR, log_to_driver=False)
pg = placement_group([{"CPU": 2}, {"CPU": 2}], strategy="STRICT_SPREAD")
ray.get(pg.ready())
print("held", flush=True)
sys.stdin.read()
"""


def test_placement_taken_by_others_exits_3_naming_what_is_missing(ray_cluster, areal_env,
                                                                  tmp_path):  # fmt: skip
    script = tmp_path / "t.py"
    script.write_text("print('never runs')\n")
    # Another driver holds every CPU of both nodes (its group goes when it exits).
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, ray_cluster.address],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        res = areal("train", "--scheduler", "ray", "--alloc", "fsdp:d2", "--nnodes", "2",
                    "--health-timeout", "3", "--servers", "none", str(script),
                    check=3, timeout=90)  # fmt: skip
        assert time.monotonic() - t0 < 40
        assert "could not place the training placement group (2 bundle(s) of 1 CPU" in res.stderr
        assert "127.0.0.2 (CPU 0/2 free)" in res.stderr
        left = ray_left(ray_cluster)
        assert not left["groups"] and not [a for a in left["actors"] if a.startswith("areal-")]
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def test_no_cluster_given_is_a_usage_error(areal_env, monkeypatch, tmp_path):
    monkeypatch.delenv("RAY_ADDRESS")
    script = tmp_path / "t.py"
    script.write_text("")
    res = areal("train", "--scheduler", "ray", "--alloc", "fsdp:d1", "--servers", "none",
                str(script), check=2)  # fmt: skip
    assert "no Ray cluster given" in res.stderr and "RAY_ADDRESS" in res.stderr


def test_cluster_refuses_a_client_without_its_token(ray_cluster, areal_env, monkeypatch, tmp_path):
    bad = tmp_path / "token"
    bad.write_text("not-the-token")
    bad.chmod(0o600)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(bad))
    script = tmp_path / "t.py"
    script.write_text("")
    res = areal("train", "--scheduler", "ray", "--alloc", "fsdp:d1", "--servers", "none",
                str(script), check=2, timeout=60)  # fmt: skip
    assert "refused areal's connection" in res.stderr and "RAY_AUTH_TOKEN_PATH" in res.stderr
    assert "not-the-token" not in res.stderr + res.stdout


def test_a_token_file_that_is_not_there_is_exit_2_with_one_message(
    ray_cluster, tiny, areal_env, monkeypatch, tmp_path
):
    """Ray's C++ client aborts the process on a missing RAY_AUTH_TOKEN_PATH (exit 1, not a
    word): `train` and `ps` of a live Ray job say what is wrong instead."""
    areal("serve", "--scheduler", "ray", "--backend", "hf", "--model", str(tiny),
          "--python", FAKE_PYTHON, "--detach", check=0, timeout=180)  # fmt: skip
    try:
        script = tmp_path / "t.py"
        script.write_text("")
        wrong = {"RAY_AUTH_TOKEN_PATH": str(tmp_path / "wrong")}
        for args in (("train", "--scheduler", "ray", "--alloc", "fsdp:d1", "--servers", "none",
                      str(script)), ("ps",)):  # fmt: skip
            res = areal(*args, env=wrong, check=2, timeout=60)
            assert f"RAY_AUTH_TOKEN_PATH={tmp_path / 'wrong'}" in res.stderr, args
            assert "does not exist" in res.stderr and "Traceback" not in res.stderr
        # The job itself is untouched: with the right file, ps sees it running.
        (job,) = [j for j in ps_json() if j["scheduler"] == "ray"]
        assert job["state"] == "running"
    finally:
        areal("stop", "default/trial0", check=0, timeout=120)


HANG = str(REPO / "tests" / "integration" / "slurm_hang.py")


def test_doctor_hang_samples_both_ray_nodes_at_once(ray_cluster, areal_env):
    """2 nodes x 2 ranks, the last rank skipping an all_reduce: each node's ranks read by the
    job's own actor there, the verdict drawn from all four."""
    from areal_cli.registry import open_registry

    reg = open_registry(str(areal_env[1]))
    job = subprocess.Popen(
        [AREAL, "train", "--scheduler", "ray", "--alloc", "fsdp:d4", "--nnodes", "2",
         "--servers", "none", HANG],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while len(reg.ranks("default", "trial0")) < 4:
            assert job.poll() is None, job.stderr.read()
            assert time.monotonic() < deadline, "the ranks did not register"
            time.sleep(0.5)
        time.sleep(2)  # past start-up: the ranks sit in the hang
        # Each node's sampler runs inside the job's actor there: no Python process started.
        samplers: set[int] = set()
        looking = threading.Event()

        def watch_for_samplers() -> None:
            while not looking.wait(0.05):
                for p in psutil.process_iter(["cmdline"]):
                    if "areal_cli.diagnose.nodes" in (p.info["cmdline"] or []):
                        samplers.add(p.pid)

        watcher = threading.Thread(target=watch_for_samplers, daemon=True)
        watcher.start()
        try:
            res = areal("doctor", "hang", "--job", "default/trial0", "--json", check=0,
                        timeout=180)  # fmt: skip
        finally:
            looking.set()
            watcher.join()
        assert not samplers
        out = json.loads(res.stdout)
        assert out["verdict"]["kind"] == "mismatched_collective", out["verdict"]
        assert out["verdict"]["odd_ranks"] == [3]
        assert {r["node"] for r in out["ranks"]} == set(ray_cluster.nodes)
        marker = reg.ranks("default", "trial0")[0].marker
    finally:
        areal("stop", "default/trial0", check=0, timeout=120)
        code = job.wait(timeout=120)
    assert code == 143
    assert marked(marker) == []
    assert not [a for a in ray_left(ray_cluster)["actors"] if a.startswith(marker)]


def test_ctrl_c_in_the_foreground_ends_the_ray_job(ray_cluster, tiny, areal_env):
    import signal

    from areal_cli.registry import open_registry

    reg = open_registry(str(areal_env[1]))
    fg = subprocess.Popen(
        [AREAL, "serve", "--scheduler", "ray", "--backend", "hf", "--model", str(tiny),
         "--python", FAKE_PYTHON],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "FAKE_REAL_PYTHON": sys.executable},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not reg.list("default", "trial0").servers:
            assert fg.poll() is None, fg.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.2)
        (entry,) = reg.list("default", "trial0").servers
        fg.send_signal(signal.SIGINT)
        _, err = fg.communicate(timeout=90)
    finally:
        if fg.poll() is None:
            fg.kill()
            fg.wait()
    assert fg.returncode == 130, err
    assert "Ray job" in err and "stopping" in err
    assert marked(entry.marker) == [] and reg.list("default", "trial0").servers == []
    assert not [a for a in ray_left(ray_cluster)["actors"] if a.startswith(entry.marker)]
    (job,) = [j for j in ps_json("--all") if j["scheduler"] == "ray"]
    assert job["state"] == "stopped"


def test_a_cluster_that_does_not_answer_is_exit_3_with_one_message(
    areal_env, monkeypatch, tmp_path
):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.2:1")  # nothing listens there
    monkeypatch.setenv("AREAL_RAY_TIMEOUT", "3")
    script = tmp_path / "t.py"
    script.write_text("")
    t0 = time.monotonic()
    res = areal("train", "--scheduler", "ray", "--alloc", "fsdp:d1", "--servers", "none",
                str(script), check=3, timeout=60)  # fmt: skip
    assert time.monotonic() - t0 < 20
    assert "did not answer within 3s" in res.stderr and "Traceback" not in res.stderr


def test_doctor_check_reports_the_ray_cluster(ray_cluster, areal_env):
    res = areal("doctor", "check", "--scheduler", "ray", "--json", timeout=120)
    rows = {r["name"]: r for r in json.loads(res.stdout)["rows"]}
    assert rows["ray"]["status"] == "pass" and "RAY_AUTH_MODE token" in rows["ray"]["detail"]
    assert rows["ray nodes"]["status"] == "pass"
    assert all(f"{n} (CPU" in rows["ray nodes"]["detail"] for n in ray_cluster.nodes)
    assert rows["shared filesystem"]["status"] == "pass", rows["shared filesystem"]
    assert "seen from 2 Ray node(s)" in rows["shared filesystem"]["detail"]
