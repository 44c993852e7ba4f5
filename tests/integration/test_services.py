"""The real Slurm cluster and etcd that the scheduler and registry tests stand on."""

from __future__ import annotations

import ssl
import time
import urllib.error
import urllib.request

import psutil
import pytest
from services import EtcdError, make_ca


def _gpu_ids(text: str) -> list[int]:
    return [int(i) for i in text.split(",") if i]


@pytest.mark.slurm
def test_two_node_job_steps_see_their_node_and_gres_gpus(slurm_cluster, tmp_path):
    out = tmp_path / "out"
    job = slurm_cluster.sbatch(
        "#!/bin/bash\n"
        "srun bash -c 'echo step $SLURMD_NODENAME $SLURM_NODEID $SLURM_PROCID $CUDA_VISIBLE_DEVICES'\n",
        *("--nodes", "2", "--ntasks-per-node", "1", "--gres", "gpu:2", "--output", str(out)),
        cwd=tmp_path,
    )
    assert slurm_cluster.wait_job(job) == "COMPLETED", out.read_text()
    steps = [line.split() for line in out.read_text().splitlines() if line.startswith("step ")]
    assert sorted(s[1] for s in steps) == sorted(slurm_cluster.nodes)
    assert sorted(s[2] for s in steps) == ["0", "1"]
    for step in steps:
        gpus = _gpu_ids(step[4])
        assert len(gpus) == 2 and all(0 <= g < slurm_cluster.gpus_per_node for g in gpus), step


@pytest.mark.slurm
def test_running_job_is_listed_reachable_on_each_node_and_cancelled(slurm_cluster, tmp_path):
    ready = tmp_path / "ready"
    job = slurm_cluster.sbatch(
        f"#!/bin/bash\nsrun bash -c 'touch {ready}.$SLURMD_NODENAME; exec sleep 300'\n",
        *("--nodes", "2", "--ntasks-per-node", "1", "--gres", "gpu:1", "--output", "/dev/null"),
        cwd=tmp_path,
    )
    try:
        for node in slurm_cluster.nodes:
            marker = tmp_path / f"ready.{node}"
            deadline = time.monotonic() + 30
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert marker.exists(), f"no task started on {node}"

        (listed,) = [j for j in slurm_cluster.squeue_json() if str(j["job_id"]) == job]
        assert listed["job_state"] == "RUNNING"
        allocated = listed["job_resources"]["allocated_nodes"]
        assert {a["nodename"] for a in allocated} == set(slurm_cluster.nodes)
        assert listed["gres_detail"] == ["gpu:1(IDX:0)"] * 2 or len(listed["gres_detail"]) == 2

        for node in slurm_cluster.nodes:
            # The step's task on this node, as `scontrol listpids` names it...
            pids = slurm_cluster.run("scontrol", "listpids", job, node).stdout.split("\n")[1:]
            step_pids = [int(line.split()[0]) for line in pids if line.split()[2:3] == ["0"]]
            assert any(psutil.Process(p).name() == "sleep" for p in step_pids), pids
            # ...and an overlapping step on that node sees it too.
            seen = slurm_cluster.run(
                *("srun", "--overlap", "--jobid", job, "-w", node, "--ntasks", "1"),
                *("bash", "-c", 'echo "$SLURMD_NODENAME"; pgrep -x sleep'),
            ).stdout.split()
            assert seen[0] == node and set(map(int, seen[1:])) & set(step_pids)
    finally:
        slurm_cluster.run("scancel", job)
    assert slurm_cluster.wait_job(job) == "CANCELLED"


@pytest.mark.slurm
def test_heterogeneous_job_starts_both_components(slurm_cluster, tmp_path):
    out = tmp_path / "out"
    # Three GPUs each: the components cannot share a node.
    job = slurm_cluster.sbatch(
        "#!/bin/bash\n"
        "#SBATCH --nodes 1 --ntasks 1 --gres gpu:3\n"
        "#SBATCH hetjob\n"
        "#SBATCH --nodes 1 --ntasks 2 --gres gpu:3\n"
        "srun --het-group=0 bash -c 'echo g0 $SLURMD_NODENAME $CUDA_VISIBLE_DEVICES' &\n"
        "srun --het-group=1 bash -c 'echo g1 $SLURMD_NODENAME $CUDA_VISIBLE_DEVICES' &\n"
        "wait\n",
        "--output",
        str(out),
        cwd=tmp_path,
    )
    assert slurm_cluster.wait_job(job) == "COMPLETED", out.read_text()
    lines = sorted(line.split() for line in out.read_text().splitlines())
    assert [w[0] for w in lines] == ["g0", "g1", "g1"], lines
    assert {w[1] for w in lines} == set(slurm_cluster.nodes)
    assert all(len(_gpu_ids(w[2])) == 3 for w in lines)


@pytest.mark.slurm
def test_a_killed_node_fails_its_job_and_comes_back(private_slurm_cluster, tmp_path):
    cluster = private_slurm_cluster
    job = cluster.sbatch(
        f"#!/bin/bash\nsrun bash -c 'touch {tmp_path}/on.$SLURMD_NODENAME; exec sleep 300'\n",
        *("--nodes", "2", "--ntasks-per-node", "1", "--no-requeue", "--output", "/dev/null"),
        cwd=tmp_path,
    )
    deadline = time.monotonic() + 30
    while len(list(tmp_path.glob("on.*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    cluster.kill_node("n2")
    assert cluster.node_state("n2").startswith("down")
    assert cluster.wait_job(job) == "NODE_FAIL"
    on_n2 = {"SLURM_CONF": str(cluster.conf_path), "SLURMD_NODENAME": "n2"}
    assert not [
        p.pid
        for p in psutil.process_iter(["environ", "status"])
        if p.info["status"] != psutil.STATUS_ZOMBIE
        and on_n2.items() <= (p.info["environ"] or {}).items()
    ]
    cluster.start_node("n2")
    assert cluster.node_state("n2") == "idle"


@pytest.mark.etcd
def test_etcd_gateway_put_range_and_lease_expiry(etcd):
    etcd.put("u/e/t/gen_servers/0", "10.0.0.1:30000")
    etcd.put("u/e/t/gen_servers_meta/0", "{}")
    assert etcd.get("u/e/t/gen_servers/0") == "10.0.0.1:30000"
    # A plain prefix read, the way AReaL reads its servers, also sees the _meta key.
    assert set(etcd.get_prefix("u/e/t/gen_servers")) == {
        "u/e/t/gen_servers/0",
        "u/e/t/gen_servers_meta/0",
    }

    lease = etcd.grant(2)
    etcd.put("u/e/t/gen_servers/1", "10.0.0.2:30000", lease=lease)
    assert etcd.keepalive(lease) == 2
    deadline = time.monotonic() + 10
    while etcd.get("u/e/t/gen_servers/1") is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert etcd.get("u/e/t/gen_servers/1") is None, "the lease did not expire"
    assert etcd.keepalive(lease) == 0

    lease = etcd.grant(30)
    etcd.put("u/e/t/gen_servers/2", "10.0.0.3:30000", lease=lease)
    etcd.revoke(lease)
    assert etcd.get("u/e/t/gen_servers/2") is None


@pytest.mark.etcd
def test_etcd_with_auth_refuses_a_wrong_password(etcd_factory):
    server = etcd_factory(auth=True)
    with pytest.raises(EtcdError) as wrong:
        server.authenticate(password="not-the-password")
    assert wrong.value.status == 400 and "authentication failed" in str(wrong.value.body)
    with pytest.raises(EtcdError) as anonymous:
        server.post("/v3/kv/range", {"key": "YQ=="}, token=False)
    assert "user name is empty" in str(anonymous.value.body)
    server.put("a", "1")  # logs in with .user / .password
    assert server.get("a") == "1"


@pytest.mark.etcd
def test_etcd_with_tls_needs_its_ca(etcd_factory, tmp_path):
    server = etcd_factory(tls=True)
    assert server.endpoint.startswith("https://")
    server.put("a", "1")
    assert server.get("a") == "1"
    other = ssl.create_default_context(cafile=str(make_ca(tmp_path / "other-ca")))
    with pytest.raises(urllib.error.URLError) as refused:
        urllib.request.urlopen(server.endpoint + "/health", timeout=10, context=other)
    assert isinstance(refused.value.reason, ssl.SSLCertVerificationError)


@pytest.mark.etcd
def test_etcd_killed_and_started_again_keeps_its_data(etcd_factory):
    server = etcd_factory()
    server.put("a", "1")
    first = server.pid
    server.kill()
    assert server.pid is None and not psutil.pid_exists(first)
    with pytest.raises(urllib.error.URLError):
        server.get("a")
    server.start()
    assert server.pid != first and server.get("a") == "1"
