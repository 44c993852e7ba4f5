"""`--scheduler slurm` on a real two-node Slurm cluster (scripts/local-slurm.sh: nodes n1 and n2
on this host, 4 fake GPUs each): serve, train, ps, logs, stop, the doctor, and every bad input
and fault a user meets, with real processes in real job steps.

One served job (real hf servers, hf:d2) is shared by the tests that only look at it; the rest
use the stand-in server (tests/fixtures/fake_python.py), which starts in milliseconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from areal_cli.registry import open_registry
from tests.conftest import our_processes
from tests.helpers import AREAL, FAKE_PYTHON, REPO, areal, wait_for

TRAIN = str(REPO / "templates" / "grpo" / "train.py")
CONFIG = str(REPO / "templates" / "grpo" / "tiny_cpu.yaml")
HANG = str(Path(__file__).with_name("slurm_hang.py"))
SCENARIOS = REPO / "tests" / "scenarios"
SLURM = ("--scheduler", "slurm")


def queued(cluster) -> list[str]:
    """Jobs pending or running on the cluster."""
    out = cluster.run("squeue", "-h", "-o", "%i").stdout.split()
    return [j for j in out if j]


def record(home: Path, kind: str = "serve", trial: str = "trial0") -> dict:
    user = os.environ.get("USER", "root")
    slot = "serve" if kind == "serve" else "train"
    return json.loads((home / "slurm" / user / "default" / trial / f"{slot}.json").read_text())


def assert_nothing_left(cluster, home: Path, registry: Path, job_id: str) -> None:
    """No queued or running Slurm job, no registry entry, no process of the job."""
    assert cluster.job_state(job_id) in ("", *cluster_ended()), cluster.job_state(job_id)
    assert job_id not in queued(cluster)
    reg = open_registry(registry)
    assert reg.list(include_dead=True).servers == []
    assert reg.ranks("default", "trial0", include_dead=True) == []
    left = wait_for_gone(home)
    assert not left, [" ".join(p.cmdline())[:100] for p in left]


def cluster_ended() -> tuple[str, ...]:
    from tests.services import ENDED

    return tuple(ENDED)


def wait_for_gone(home: Path, timeout: float = 10.0) -> list:
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in our_processes(home) if "pytest" not in " ".join(p.cmdline())]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


# ----------------------------------------------------------------- one served job, shared


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from areal_cli.modelgen import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=0)


class Served:
    def __init__(self, cluster, home: Path, registry: Path, out: dict):
        self.cluster, self.home, self.registry, self.out = cluster, home, registry, out
        self.job_id = out["job_id"]

    @property
    def env(self) -> dict:
        return {**self.cluster.env, "AREAL_HOME": str(self.home),
                "AREAL_REGISTRY": str(self.registry)}  # fmt: skip

    def areal(self, *args, **kw):
        return areal(*args, env=self.env, **kw)


@pytest.fixture(scope="module")
def served(slurm_cluster, tiny, tmp_path_factory):
    """`areal serve --scheduler slurm --backend hf --alloc hf:d2 --detach` with real hf servers;
    stopped at the end of the module (the last test checks that it leaves nothing)."""
    base = tmp_path_factory.mktemp("slurm-served")
    home, registry = base / "home", base / "registry"
    env = {**slurm_cluster.env, "AREAL_HOME": str(home), "AREAL_REGISTRY": str(registry)}
    res = areal("serve", *SLURM, "--backend", "hf", "--alloc", "hf:d2", "--model", str(tiny),
                "--detach", "--json", env=env, timeout=240)  # fmt: skip
    assert res.returncode == 0, res.stderr
    s = Served(slurm_cluster, home, registry, json.loads(res.stdout))
    yield s
    areal("stop", "default/trial0", env=env, timeout=60)
    for p in our_processes(home):
        p.kill()


def test_serve_puts_one_server_on_each_node_registered_with_the_node_address(served):
    entries = open_registry(served.registry).list("default", "trial0").servers
    assert sorted(e.node for e in entries) == ["n1", "n2"]
    for e in entries:
        # Both nodes are this host at NodeAddr 127.0.0.1: the node's address, a port of its own.
        assert e.addr.startswith("127.0.0.1:") and e.scheduler == "slurm"
        assert e.scheduler_job_id.split(".")[0] == served.job_id
        assert e.api_key_required  # on a cluster a key is made even without --api-key
    key = json.loads(
        (served.home / "jobs" / os.environ.get("USER", "root") / "default" / "trial0"
         / "api_key.json").read_text()
    )["key"]  # fmt: skip
    for e in entries:
        req = urllib.request.Request(
            f"http://{e.addr}/generate",
            data=json.dumps({"text": "ab", "sampling_params": {"max_new_tokens": 2}}).encode(),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200 and "text" in json.loads(r.read())
    with pytest.raises(urllib.error.HTTPError) as refused:  # the servers want the key
        urllib.request.urlopen(req.full_url, data=req.data, timeout=30)
    assert refused.value.code == 401
    # The key is in no batch script and no command line Slurm shows.
    script = served.cluster.run("scontrol", "write", "batch_script", served.job_id, "-").stdout
    assert key not in script and "srun" in script


def test_ps_lists_the_slurm_job_with_its_id_state_and_nodes(served):
    rows = json.loads(served.areal("ps", "--json", check=0).stdout)
    (row,) = [r for r in rows if r["scheduler"] == "slurm"]
    assert row["job_id"] == served.job_id and row["state"] == "running"
    assert row["nodes"] == ["n1", "n2"] and row["kind"] == "serve"
    assert sorted(s["node"] for s in row["servers"]) == ["n1", "n2"]
    assert all(s["healthy"] for s in row["servers"])
    text = served.areal("ps", check=0).stdout
    assert f"slurm {served.job_id}" in text.replace("\n", " ") or served.job_id in text


def test_logs_read_the_files_on_the_shared_filesystem(served):
    out = served.areal("logs", "default/trial0", "--role", "server", check=0).stdout
    assert "[server-0]" in out and "[server-1]" in out and "registered 127.0.0.1:" in out


def test_train_runs_grpo_across_both_nodes_and_the_reward_rises(served):
    res = served.areal("train", *SLURM, "--alloc", "fsdp:d2", "--gpus-per-node", "1",
                       TRAIN, "--config", CONFIG, "steps=16", timeout=420)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "training finished with exit code 0" in res.stderr
    assert "running Slurm job" in res.stderr
    logs = served.home / "logs" / os.environ.get("USER", "root") / "default" / "trial0"
    # One torchrun per node (rank 0 prints the table, in its own log).
    assert (logs / "torchrun-n1.log").exists() and (logs / "torchrun-n2.log").exists()
    assert "2 rank(s)" in (logs / "rank-0.log").read_text()
    rows = [json.loads(x) for x in (logs / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rewards = [r["reward_mean"] for r in rows]
    assert len(rows) == 16
    assert sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5 >= 0.2, rewards
    rec = record(served.home, "train")
    assert rec["state"] == "stopped" and rec["exit_code"] == 0


def test_stop_leaves_no_process_no_slurm_job_and_no_registry_entry(served):
    follow = subprocess.Popen(
        [AREAL, "logs", "default/trial0", "-f", "--role", "server"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **served.env},
    )  # fmt: skip
    res = served.areal("stop", "default/trial0", "--json", check=0)
    (result,) = json.loads(res.stdout)
    assert result["was_running"] and result["cancelled"] == f"Slurm job {served.job_id}"
    # `areal logs -f` follows the files until the job has ended.
    out, _ = follow.communicate(timeout=30)
    assert follow.returncode == 0 and "[server-1]" in out
    assert_nothing_left(served.cluster, served.home, served.registry, served.job_id)
    rows = json.loads(served.areal("ps", "--all", "--json", check=0).stdout)
    assert {r["state"] for r in rows if r["kind"] == "serve"} == {"stopped"}


# ----------------------------------------------------------------- jobs of their own


def test_a_combined_allocation_is_one_heterogeneous_submission(slurm_env, areal_env, tmp_path):
    home, registry = areal_env
    script = tmp_path / "found.py"
    script.write_text(
        "from areal_cli import worker\n"
        "ctx = worker.connect()\n"
        "print('servers', ','.join(ctx.servers), 'key', bool(ctx.api_key), flush=True)\n"
        "worker.close()\n"
    )
    res = areal("train", *SLURM, "--alloc", "hf:d1+fsdp:d1", "--model", "org/tiny",
                "--python", FAKE_PYTHON, str(script), timeout=180)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rec = record(home, "serve+train")
    job = rec["job_id"]
    # One job id, two components (servers, trainers) on their own nodes.
    parts = slurm_env.run("squeue", "-h", "-t", "all", "-j", job, "-o", "%i %N").stdout.split("\n")
    assert sorted(p.split()[0] for p in parts if p) == [f"{job}+0", f"{job}+1"]
    # The trainer found the job's own server in the registry at run time, with its key.
    rank0 = home / "logs" / os.environ.get("USER", "root") / "default" / "trial0" / "rank-0.log"
    line = next(x for x in rank0.read_text().splitlines() if x.startswith("servers"))
    assert line.split()[1].startswith("127.0.0.1:") and line.endswith("key True")
    assert "healthy server-0 at http://127.0.0.1:" in res.stderr
    assert_nothing_left(slurm_env, home, registry, job)


def test_doctor_hang_finds_every_rank_on_every_node_and_names_the_odd_one(
    slurm_env, areal_env, tmp_path
):
    """A hung two-node job (the last rank skips an all_reduce): the doctor names rank 3 and its
    node. The script never joins through worker.connect(), so no rank is in the rank table:
    the doctor finds them on each node by the job's marker (the node-death test covers the
    rank table). Then the job is cancelled from outside while `areal train` waits: exit 1."""
    home, registry = areal_env
    scenario = tmp_path / "scenario"
    scenario.mkdir()
    proc = subprocess.Popen(
        [AREAL, *("train", *SLURM, "--alloc", "fsdp:d4", "--gpus-per-node", "2"),
         "--servers", "none", str(SCENARIOS / "skip_allreduce.py")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "SCENARIO_DIR": str(scenario), "SCENARIO_LIFETIME": "300"},
    )  # fmt: skip
    try:

        def all_ranks() -> bool:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            return len(list(scenario.glob("ready-*"))) == 4

        wait_for(all_ranks, 240, "4 ranks did not get ready")
        res = areal("doctor", "hang", "--job", "default/trial0", "--json", timeout=120)
        assert res.returncode == 0, res.stderr
        report = json.loads(res.stdout)
        assert report["verdict"]["kind"] == "mismatched_collective"
        assert report["verdict"]["odd_ranks"] == [3]
        nodes = {r["rank"]: r["node"] for r in report["ranks"]}
        # Two ranks per node (c10d numbers the nodes in the order they join).
        assert sorted(nodes) == [0, 1, 2, 3] and sorted(nodes.values()) == ["n1", "n1", "n2", "n2"]
        text = areal("doctor", "hang", "--job", "default/trial0", timeout=120).stdout
        assert f"odd ranks: 3 (node {nodes[3]})" in text and f"on {nodes[3]}" in text
        # Cancelled outside areal while `areal train` follows it.
        job = record(home, "train")["job_id"]
        slurm_env.run("scancel", job)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 1, err[-2000:]
        assert "cancelled" in err and "Traceback" not in err
        assert_nothing_left(slurm_env, home, registry, job)
        rows = json.loads(areal("ps", "--all", "--json", check=0).stdout)
        assert [r["state"] for r in rows if r["job_id"] == job] == ["cancelled"]
    finally:
        if proc.poll() is None:
            proc.kill()
            areal("stop", "default/trial0")


def test_ctrl_c_in_the_foreground_cancels_the_job(slurm_env, areal_env, tmp_path):
    home, registry = areal_env
    proc = subprocess.Popen(
        [AREAL, "serve", *SLURM, "--backend", "hf", "--model", "org/tiny", "--python",
         FAKE_PYTHON],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "FAKE_REAL_PYTHON": sys.executable},
    )  # fmt: skip
    try:

        def ready() -> bool:
            assert proc.poll() is None, proc.communicate()
            try:
                return record(home)["state"] == "running"  # written once the servers are ready
            except OSError:
                return False

        wait_for(ready, 60, "the job did not get ready")
        job = record(home)["job_id"]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert "ready" in err and "Traceback" not in err
        assert_nothing_left(slurm_env, home, registry, job)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_killing_areal_leaves_the_batch_job_running_and_stop_still_ends_it(slurm_env, areal_env):
    home, registry = areal_env
    proc = subprocess.Popen(
        [AREAL, "serve", *SLURM, "--backend", "hf", "--alloc", "hf:d2", "--model", "org/tiny",
         "--python", FAKE_PYTHON],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "FAKE_REAL_PYTHON": sys.executable},
    )  # fmt: skip
    reg = open_registry(registry)
    wait_for(lambda: len(reg.list("default", "trial0").servers) == 2, 120, "servers not up")
    proc.kill()
    proc.wait()
    job = record(home)["job_id"]
    time.sleep(0.5)
    assert slurm_env.job_state(job) == "RUNNING"
    assert len(reg.list("default", "trial0").servers) == 2
    res = areal("stop", "default/trial0", check=0)
    assert "stopped" in res.stdout
    assert_nothing_left(slurm_env, home, registry, job)


def test_a_job_pending_past_the_health_timeout_is_cancelled_with_squeue_reason(
    slurm_env, areal_env
):
    home, _ = areal_env
    res = areal("serve", *SLURM, "--backend", "hf", "--model", "org/tiny", "--python",
                FAKE_PYTHON, "--slurm-arg=--hold", "--health-timeout", "1.5", "--detach",
                timeout=60)  # fmt: skip
    assert res.returncode == 3, res.stderr
    assert "still pending after 1.5s" in res.stderr and "JobHeldUser" in res.stderr
    assert "Traceback" not in res.stderr
    job = record(home)["job_id"]
    assert slurm_env.job_state(job) == "CANCELLED"


# ----------------------------------------------------------------- bad input: exit 2, no job


def test_no_sbatch_on_path_says_how_to_get_it(areal_env, tmp_path):
    res = areal("serve", *SLURM, "--backend", "hf", "--model", "org/tiny", "--detach",
                env={"PATH": str(tmp_path)})  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert "sbatch is not on PATH" in res.stderr and "slurm-client" in res.stderr
    assert "--scheduler local" in res.stderr and "Traceback" not in res.stderr


def test_slurm_options_need_the_slurm_scheduler(areal_env):
    res = areal("serve", "--backend", "hf", "--model", "org/tiny", "--partition", "gpu",
                "--dry-run")  # fmt: skip
    assert res.returncode == 2 and "--scheduler slurm" in res.stderr


def test_bad_partition_account_and_gpus_are_refused_before_anything_runs(slurm_env, areal_env):
    before = queued(slurm_env)
    serve = ("serve", *SLURM, "--backend", "hf", "--model", "org/tiny", "--python", FAKE_PYTHON,
             "--detach", "--health-timeout", "30")  # fmt: skip
    res = areal(*serve, "--partition", "nope")
    assert res.returncode == 2, res.stderr
    assert "Slurm refused the job: invalid partition specified: nope" in res.stderr
    # An account the partition does not allow: Slurm's own words.
    slurm_env.run("scontrol", "create", "PartitionName=acct", "Nodes=n1,n2",
                  "AllowAccounts=research", "State=UP")  # fmt: skip
    try:
        res = areal(*serve, "--partition", "acct", "--account", "nobody")
        assert res.returncode == 2, res.stderr
        assert "AccountNotAllowed" in res.stderr or "account" in res.stderr.lower()
    finally:
        slurm_env.run("scontrol", "delete", "PartitionName=acct")
    res = areal(*serve, "--gpus-per-node", "8")
    assert res.returncode == 2, res.stderr
    assert "--gpus-per-node 8: the nodes of partition debug have 4 GPU(s) each" in res.stderr
    res = areal("train", *SLURM, "--alloc", "fsdp:d6", "--gpus-per-node", "4", "--servers",
                "none", HANG)  # fmt: skip
    assert res.returncode == 2 and "do not split over nodes of 4 GPUs" in res.stderr
    res = areal("train", *SLURM, "--alloc", "fsdp:d12", "--gpus-per-node", "4", "--servers",
                "none", HANG)  # fmt: skip
    assert res.returncode == 2 and "needs 3 node(s)" in res.stderr and "has 2" in res.stderr
    res = areal(*serve[:3], "--alloc", "hf:d1t2", "--model", "org/tiny", "--dry-run")
    assert res.returncode == 2 and "cannot span GPUs or nodes" in res.stderr
    assert queued(slurm_env) == before
    assert "Traceback" not in res.stderr


def test_a_replica_wider_than_a_node_is_one_multi_node_server(slurm_env, areal_env):
    """sglang:d1t8 on nodes of 4 GPUs: one server over two nodes, meeting at an address the
    first node picks (flags as SGLang 0.5.23 and vLLM 0.33 document them, see planner.py)."""
    for backend, follower in (("sglang", []), ("vllm", ["--headless"])):
        res = areal("serve", *SLURM, "--backend", backend, "--alloc", f"{backend}:d1t8",
                    "--model", "org/m", "--dry-run", "--json",
                    "--allow-unauthenticated-control")  # fmt: skip
        assert res.returncode == 0, res.stderr
        plan = json.loads(res.stdout)
        (p,) = plan["processes"]
        assert p["nodes"] == 2 and p["gpus_per_node"] == 4 and p["follower_args"] == follower
        # Ready means a generation was answered on Slurm too (vLLM's CPU build passed /health
        # and died on its first forward pass); SGLang's /ready covers its own warm-up.
        assert (p["first_request"] is not None) == (backend == "vllm"), p["first_request"]
        argv = " ".join(p["argv"])
        if backend == "sglang":
            assert "--dist-init-addr {dist_addr} --nnodes 2 --node-rank {node_rank}" in argv
        else:
            assert "--nnodes 2 --node-rank {node_rank} --master-addr {dist_host}" in argv
        assert (
            "--nodes=2 --ntasks=2 --ntasks-per-node=1 --relative=0 --gres=gpu:4" in plan["script"]
        )


def test_job_yaml_carries_the_slurm_options(slurm_env, areal_env, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(
        "scheduler: slurm\nbackend: hf\nmodel: org/tiny\nalloc: hf:d2\npartition: debug\n"
        "gpus_per_node: 2\ntime: '1:00:00'\nslurm_arg: ['--mem=1G']\n"
    )
    res = areal("serve", "--config", str(job), "--dry-run", "--json")
    assert res.returncode == 0, res.stderr
    script = json.loads(res.stdout)["script"]
    for line in (
        "#SBATCH --partition=debug",
        "#SBATCH --time=1:00:00",
        "#SBATCH --mem=1G",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=2",
        "#SBATCH --gres=gpu:2",
    ):
        assert line in script.splitlines(), (line, script)  # fmt: skip


def test_doctor_check_reports_the_cluster(slurm_env, areal_env):
    res = areal("doctor", "check", "--scheduler", "slurm", "--json", timeout=120)
    rows = {r["name"]: r for r in json.loads(res.stdout)["rows"]}
    assert rows["slurm"]["status"] == "pass" and "slurm-wlm 22.05" in rows["slurm"]["detail"]
    assert rows["partition debug"]["status"] == "pass"
    assert "4 GPU(s)" in rows["partition debug"]["detail"]
    assert rows["shared filesystem"]["status"] == "pass", rows["shared filesystem"]


def test_squeue_and_sinfo_fields_are_read_across_slurm_versions():
    """What cluster.py reads: 22.05's exit code is a wait status, 23.x and later a dict; gres
    strings with and without a type and socket binding."""
    from areal_cli.schedulers.slurm import cluster

    assert cluster._exit(768) == 3 and cluster._exit(15) == 143 and cluster._exit(0) == 0
    assert cluster._exit({"return_code": {"number": 5}, "signal": {"id": {"number": 0}}}) == 5
    assert cluster._exit({"return_code": 0, "signal": {"id": {"number": 9}}}) == 137
    assert cluster._state(["CANCELLED", "COMPLETING"]) == "CANCELLED"
    assert cluster.gpu_count("gpu:4") == 4 and cluster.gpu_count("gpu:a100:8(S:0-1)") == 8
    assert cluster.gpu_count("gpu:2,shard:8") == 2 and cluster.gpu_count("(null)") == 0
    assert cluster.expand("n1,n2") == ["n1", "n2"] and cluster.expand("") == []


def test_squeue_errors_beside_an_empty_list_are_no_answer_not_no_jobs(monkeypatch, tmp_path):
    """What Slurm 22.05's squeue --json printed, with exit 0, while slurmctld was SIGSTOPped
    (scripts/local-slurm.sh's cluster): an empty job list that means nothing."""
    from areal_cli.schedulers.slurm import cluster

    hung = {
        "meta": {"Slurm": {"release": "22.05.8"}},
        "errors": [{"description": "Failed while looking for jobs", "error_number": -1,
                    "error": "Unspecified error", "source": "slurm_load_jobs"}],
        "jobs": [],
    }  # fmt: skip
    conf = tmp_path / "slurm.conf"
    conf.write_text("SlurmctldHost=ctl1(10.0.0.1)\nSlurmctldHost=ctl2\nSlurmctldPort=6820\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    with pytest.raises(cluster.Unreachable) as got:
        cluster.parse_jobs(hung, ["12"])
    assert got.value.exit_code == 3
    assert got.value.message.startswith("slurmctld at ctl1:6820, ctl2:6820 did not answer squeue")
    assert "Failed while looking for jobs" in got.value.message
    assert cluster.parse_jobs({"jobs": []}, ["12"]) == {}
