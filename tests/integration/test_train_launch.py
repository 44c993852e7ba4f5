"""`areal train` with real torchrun (gloo, CPU) against stand-in servers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers import AREAL, REPO, areal, fake_serve_args

SCRIPT = str(REPO / "tests" / "fixtures" / "scripts" / "record_env.py")


@pytest.fixture
def model(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    return d


@pytest.fixture
def served(model):
    """Two stand-in servers registered under default/trial0 by a detached `areal serve`."""
    out = json.loads(
        areal(*fake_serve_args(model, "--alloc", "hf:d2", "--detach", "--json"), check=0).stdout
    )
    yield [s["addr"] for s in out["servers"]]
    areal("stop", "default/trial0", "--kind", "serve", check=0)


def records(d, n):
    return [json.loads((d / f"rank-{r}.json").read_text()) for r in range(n)]


def test_training_only_alloc_finds_registered_servers(served, tmp_path):
    rec = tmp_path / "rec"
    rec.mkdir()
    res = areal("train", "--alloc", "fsdp:d2", SCRIPT, "--config", "mine.yaml", "lr=0.1",
                env={"RECORD_DIR": str(rec)}, check=0, timeout=120)  # fmt: skip
    assert "[rank-0] rank 0 recorded" in res.stderr and "[rank-1]" in res.stderr
    r0, r1 = records(rec, 2)
    # Everything after SCRIPT is the script's, even an option areal train also has.
    assert r0["argv"] == ["--config", "mine.yaml", "lr=0.1"]
    env = r0["env"]
    assert sorted(env["AREAL_LLM_SERVER_ADDRS"].split(",")) == sorted(served)
    assert env["AREAL_SERVER_BACKEND"] == "hf" and env["AREAL_ALLOC"] == "fsdp:d2"
    assert env["AREAL_EXPERIMENT"] == "default" and env["AREAL_TRIAL"] == "trial0"
    assert env["AREAL_LOG_DIR"].endswith("default/trial0") and env["AREAL_REGISTRY"]
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and env["TOKENIZERS_PARALLELISM"] == "false"
    assert env["WORLD_SIZE"] == "2" and r1["env"]["RANK"] == "1"
    log_dir = env["AREAL_LOG_DIR"]
    assert "rank 1 recorded" in open(os.path.join(log_dir, "rank-1.log")).read()


def test_areal_overrides_and_debug_preset(served):
    # What reaches the workers is in the plan: no torchrun needed to check it.
    plan = json.loads(areal("train", "--alloc", "fsdp:d1", "--areal-overrides", "--debug-preset",
                            "hang", "--dry-run", "--json", SCRIPT, "--config", "x.yaml", check=0).stdout)  # fmt: skip
    (tr,) = plan["processes"]
    argv = tr["argv"][tr["argv"].index(SCRIPT) + 1 :]
    assert argv[:2] == ["--config", "x.yaml"]
    # No AReaL in this interpreter (a dry run plans anyway): AReaL ≥ 1.0's keys, in hydra's
    # add-or-override form; an hf server speaks SGLang's protocol.
    assert "++rollout.backend=sglang:d2" in argv and "++actor.backend=fsdp:d1" in argv
    assert not [a for a in argv if "allocation_mode" in a]
    assert "++cluster.name_resolve.type=nfs" in argv
    assert f"++cluster.name_resolve.nfs_record_root={os.environ['AREAL_REGISTRY']}" in argv
    assert "++rollout.experiment_name=default" in argv and "++rollout.trial_name=trial0" in argv
    assert "++actor.experiment_name=default" in argv and "++actor.trial_name=trial0" in argv
    assert tr["env"]["AREAL_SPMD_MODE"] == "1"
    assert tr["env"].get("TORCH_DISTRIBUTED_DEBUG") == "DETAIL"


def test_failing_rank_is_the_root_cause(served, tmp_path):
    rec = tmp_path / "rec"
    rec.mkdir()
    res = areal("train", "--alloc", "fsdp:d2", SCRIPT, env={"RECORD_DIR": str(rec), "FAIL_RANK": "1"},
                check=1, timeout=120)  # fmt: skip
    assert "rank-1 failed" in res.stderr and "exit code 5" in res.stderr
    assert "rank failing on purpose" in res.stderr and "rank-1.log" in res.stderr


def test_no_servers_exits_3_in_time(tmp_path):
    t0 = time.monotonic()
    res = areal("train", "--alloc", "fsdp:d2", "--wait-servers", "2", SCRIPT, check=3)
    took = time.monotonic() - t0
    assert took < 2 + 4, took
    reg = os.environ["AREAL_REGISTRY"]
    assert f"{reg}/" in res.stderr and "gen_servers" in res.stderr
    assert "areal serve --model MODEL --experiment default --trial trial0" in res.stderr


def test_combined_allocation_starts_and_stops_together(model, tmp_path):
    rec = tmp_path / "rec"
    rec.mkdir()
    pidfile = tmp_path / "pids"
    res = areal("train", "--alloc", "hf:d1+fsdp:d2", "--model", str(model), "--python",
                str(REPO / "tests/fixtures/fake_python.py"), SCRIPT,
                env={"RECORD_DIR": str(rec), "FAKE_SERVER_PIDFILE": str(pidfile)}, check=0, timeout=120)  # fmt: skip
    assert "healthy server-0" in res.stderr
    (r0, _) = records(rec, 2)
    assert r0["env"]["AREAL_LLM_SERVER_ADDRS"].startswith("127.0.0.1:")
    server_pids = [int(x) for x in pidfile.read_text().split()]
    assert not any(psutil.pid_exists(p) for p in server_pids)
    assert json.loads(areal("ps", "--all", "--json", check=0).stdout)[0]["kind"] == "serve+train"


def test_sigkill_of_areal_train_kills_workers(served, tmp_path):
    rec = tmp_path / "rec"
    rec.mkdir()
    env = {**os.environ, "RECORD_DIR": str(rec), "SLEEP": "1"}
    proc = subprocess.Popen([AREAL, "train", "--alloc", "fsdp:d2", SCRIPT], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(list(rec.glob("rank-*.json"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [r["pid"] for r in records(rec, 2)]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 6
        while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(psutil.pid_exists(p) for p in pids), "workers survived SIGKILL of areal"
    finally:
        proc.kill()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--alloc", "sglang:d2", SCRIPT], "no train component"),
        (["--alloc", "fsdp:d2", "missing.py"], "does not exist"),
        (["--alloc", "fsdp:d64", "--servers", "127.0.0.1:1", SCRIPT], "not reachable"),
        (["--alloc", "fsdp:d2x", SCRIPT], "bad allocation"),
        (["--alloc", "fsdp:d2", "--servers", "nohost", SCRIPT], "not host:port"),
        ([SCRIPT], "--alloc is required"),
    ],
)
def test_bad_input_exits_2(args, needle):
    res = areal("train", *args, check=2)
    assert needle in res.stderr and "Traceback" not in res.stderr


def test_more_ranks_than_allowed_on_cpu(served):
    res = areal("train", "--alloc", "fsdp:d64", SCRIPT, check=2)
    assert "64 ranks on CPU" in res.stderr


def test_dry_run_prints_torchrun_and_starts_nothing(served):
    plan = json.loads(
        areal("train", "--alloc", "fsdp:d2", "--dry-run", "--json", SCRIPT, check=0).stdout
    )
    (tr,) = plan["processes"]
    assert tr["argv"][1:3] == ["-m", "torch.distributed.run"] and "--nproc-per-node" in tr["argv"]
    # One node: the OS picks the rendezvous port when torchrun binds it, so no plan holds one.
    assert "--standalone" in tr["argv"] and "--master-port" not in tr["argv"]
    assert tr["env"]["AREAL_MESH"] == "pp=1,dp=2,cp=1,tp=1"
    assert tr["env"]["AREAL_LLM_SERVER_ADDRS"]
    assert os.path.dirname(tr["argv"][0]) == os.path.dirname(sys.executable)


def test_module_entry_point_goes_to_torchrun_as_dash_m():
    plan = json.loads(areal("train", "--alloc", "fsdp:d1", "--servers", "none", "--dry-run",
                            "--json", "--", "-m", "pkg.train", "--config", "x.yaml", check=0).stdout)  # fmt: skip
    argv = plan["processes"][0]["argv"]
    assert argv[-4:] == ["-m", "pkg.train", "--config", "x.yaml"]


def test_two_jobs_started_at_once_both_run(areal_env, tmp_path):
    """Each job's torchrun binds a port the OS chose, recorded in its job record."""
    env = {**os.environ, "COLUMNS": "200"}
    procs_ = [
        subprocess.Popen([AREAL, "train", "--alloc", "fsdp:d2", "--servers", "none", "--trial",
                          f"t{i}", SCRIPT], env={**env, "RECORD_DIR": str(tmp_path)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]  # fmt: skip
    outs = [p.communicate(timeout=180)[0] for p in procs_]
    for p, out in zip(procs_, outs, strict=True):
        assert p.returncode == 0, out
    home = areal_env[0]
    ports = set()
    for i in range(2):
        (rec,) = home.glob(f"jobs/*/default/t{i}/train.json")
        (torchrun,) = json.loads(rec.read_text())["processes"]
        ports.add(torchrun["addr"])
    assert len(ports) == 2 and all(a.startswith("127.0.0.1:") for a in ports)
