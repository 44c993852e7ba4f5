"""`areal serve` supervision with real processes: a stand-in server binary (tests/fixtures/
fake_python.py) that answers /health and forks a grandchild, so teardown is tested fast."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import psutil
import pytest

from areal_cli.registry import FileRegistry
from tests.helpers import AREAL, FAKE_PYTHON, areal, fake_serve_args


@pytest.fixture
def model(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    return d


def _pids(pidfile):
    if not pidfile.exists():
        return []
    return [int(x) for line in pidfile.read_text().split("\n") if line for x in line.split()]


def _wait(pred, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def _entries(reg_root):
    return FileRegistry(reg_root).list().servers


def test_detach_ps_logs_stop(model, areal_env, tmp_path):
    home, reg = areal_env
    pidfile = tmp_path / "pids"
    env = {"FAKE_SERVER_PIDFILE": str(pidfile)}
    out = areal(*fake_serve_args(model, "--alloc", "hf:d2", "--detach", "--json"), env=env, check=0)
    info = json.loads(out.stdout)
    assert len(info["servers"]) == 2
    # Registered in AReaL's layout: gen_servers/<id>/ENTRY holds host:port and nothing else.
    gen = reg / os.environ.get("USER", "root") / "default" / "trial0" / "gen_servers"
    for d in gen.iterdir():
        assert os.listdir(d) == ["ENTRY"]
        assert (d / "ENTRY").read_text() in {s["addr"] for s in info["servers"]}
    ps = json.loads(areal("ps", "--json", check=0).stdout)
    (job,) = ps
    assert job["experiment"] == "default" and job["trial"] == "trial0" and job["kind"] == "serve"
    assert job["state"] == "running" and all(s["healthy"] for s in job["servers"])
    assert set(job["pids"]) >= {s["pid"] for s in info["servers"]}
    logs = areal("logs", "default/trial0", "--role", "server", "--index", "1", check=0).stdout
    assert "[server-1]" in logs and "fake server listening" in logs and "[server-0]" not in logs
    # A second job with the same experiment/trial is refused, naming the running one.
    again = areal(*fake_serve_args(model, "--detach"), check=2)
    assert "already running" in again.stderr and "default/trial0" in again.stderr
    areal("stop", "default/trial0", check=0)
    assert _wait(lambda: not any(psutil.pid_exists(p) for p in _pids(pidfile)), 5)
    assert _entries(reg) == []
    ps = json.loads(areal("ps", "--all", "--json", check=0).stdout)
    assert ps[0]["state"] == "stopped"


def test_detach_says_ready_without_asking_the_servers_again(model, areal_env, tmp_path):
    # Each runner registered its server once it answered /health: the command's report of
    # the ready job asks no server a second time (SGLang's /health takes a second and more).
    asked = tmp_path / "asked"
    env = {"FAKE_SERVER_REQUESTS": str(asked), "AREAL_REGISTRY_TTL": "120"}
    out = areal(*fake_serve_args(model, "--alloc", "hf:d2", "--detach", "--json"), env=env, check=0)
    servers = json.loads(out.stdout)["servers"]
    assert len(servers) == 2 and all(s["addr"] and s["pid"] for s in servers)
    try:
        assert asked.read_text().splitlines() == ["GET /health"] * 2
    finally:
        areal("stop", "default/trial0", check=0)


def test_sigint_tears_down_everything(model, areal_env, tmp_path):
    home, reg = areal_env
    pidfile = tmp_path / "pids"
    env = {**os.environ, "FAKE_REAL_PYTHON": os.sys.executable, "FAKE_SERVER_PIDFILE": str(pidfile)}
    proc = subprocess.Popen([AREAL, *fake_serve_args(model, "--alloc", "hf:d2")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert _wait(lambda: len(_entries(reg)) == 2, 20), "servers never registered"
        assert len(_pids(pidfile)) == 4  # two servers, two grandchildren
        # Ready once the supervisor has seen both registered (the record says running).
        assert _wait(lambda: '"running"' in areal("ps", "--json").stdout, 20)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "[server-0]" in err and "healthy" in err
    assert not any(psutil.pid_exists(p) for p in _pids(pidfile))
    assert _entries(reg) == []


def test_sigkill_of_areal_still_kills_servers_and_grandchildren(model, areal_env, tmp_path):
    home, reg = areal_env
    pidfile = tmp_path / "pids"
    env = {**os.environ, "FAKE_REAL_PYTHON": os.sys.executable, "FAKE_SERVER_PIDFILE": str(pidfile)}
    proc = subprocess.Popen([AREAL, *fake_serve_args(model, "--alloc", "hf:d2")], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        assert _wait(lambda: len(_entries(reg)) == 2, 20)
        pids = _pids(pidfile)
        proc.kill()
        proc.wait()
        killed_at = time.monotonic()
        assert _wait(lambda: not any(psutil.pid_exists(p) for p in pids), 8), "survivors"
        took = time.monotonic() - killed_at
    finally:
        proc.kill()
    assert took < 5, f"teardown after SIGKILL took {took:.1f}s"
    assert _wait(lambda: _entries(reg) == [], 3)
    rec = json.loads(areal("ps", "--all", "--json", check=0).stdout)[0]
    assert rec["state"] == "killed"


def test_health_timeout_exits_3(model):
    res = areal(
        *fake_serve_args(model, "--health-timeout", "1"), env={"FAKE_SERVER_MODE": "never"}, check=3
    )
    assert "not healthy after 1s" in res.stderr and "server-0" in res.stderr


def test_replica_crashing_at_start_is_reported_root_cause_first(model, areal_env):
    res = areal(
        *fake_serve_args(model, "--alloc", "hf:d2"), env={"FAKE_SERVER_MODE": "crash"}, check=1
    )
    assert "failed while starting: exit code 7" in res.stderr
    assert "fatal: cannot load model" in res.stderr  # the log tail
    assert _entries(areal_env[1]) == []


def test_lost_replica_is_deregistered_and_others_keep_serving(model, areal_env, tmp_path):
    home, reg = areal_env
    # Not restarted (--max-restarts 0): a lost replica as such (test_server_heal restarts).
    args = fake_serve_args(model, "--alloc", "hf:d2", "--max-restarts", "0", "--detach", "--json")
    out = json.loads(areal(*args, check=0).stdout)
    try:
        victim = out["servers"][0]
        p = psutil.Process(victim["pid"])
        p.kill()
        _wait(lambda: not p.is_running() or p.status() == psutil.STATUS_ZOMBIE, 5)
        # Readers never get the dead server, even before the supervisor deregisters it.
        assert victim["addr"] not in [e.addr for e in _entries(reg)]
        assert _wait(lambda: len(_entries(reg)) == 1, 5)
        job = json.loads(areal("ps", "--json", check=0).stdout)[0]
        assert job["state"] == "running"
        assert [s["healthy"] for s in job["servers"]] == [False, True]
    finally:
        areal("stop", "default/trial0", check=0)


def test_dry_run_starts_nothing(model, areal_env):
    res = areal(*fake_serve_args(model, "--alloc", "hf:d2", "--dry-run", "--json"), check=0)
    plan = json.loads(res.stdout)
    assert [p["port"] for p in plan["processes"]] == sorted(p["port"] for p in plan["processes"])
    assert plan["processes"][0]["argv"][1:3] == ["-m", "areal_cli.server"]
    assert all(p["env"]["CUDA_VISIBLE_DEVICES"] == "" for p in plan["processes"])
    assert not (areal_env[0] / "jobs").exists()


def test_port_base_in_use_names_the_holder(model):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = areal(*fake_serve_args(model, "--port-base", str(port)), check=2)
    assert f"port {port}" in res.stderr and f"pid {os.getpid()}" in res.stderr


def test_bad_input_exits_2_without_traceback(model, tmp_path):
    cases = [
        (["serve", "--model", str(model), "--alloc", "sglang:d0"], "bad allocation"),
        (
            ["serve", "--model", str(model), "--alloc", "sglang.d4p1t1+d4p1t1"],
            "sglang:d4t1+fsdp:d4",
        ),
        (["serve", "--model", str(model), "--alloc", "hf:d1+fsdp:d2"], "train component"),
        (["serve", "--model", str(tmp_path / "nope")], "does not exist"),
        (["serve", "--model", str(model), "--backend", "sglang"], "make engines"),
        (
            ["serve", "--model", str(model), "--backend", "sglang", "--gpus", "0"],
            "areal-cli[sglang]",
        ),
        (["serve", "--model", str(model), "--backend", "vllm", "--gpus", "0"], "areal-cli[vllm]"),
        (["serve", "--model", str(model), "--backend", "nope"], "unknown backend"),
        (
            ["serve", "--model", str(model), "--python", str(tmp_path / "nopython")],
            "does not exist",
        ),
        (["serve", "--model", str(model), "--gpus", "0,x"], "not a GPU index"),
        (["serve", "--model", str(model), "--experiment", "a/b"], "not usable"),
        (["serve", "--model", str(model), "--no-such-flag"], "No such option"),
        (["stop", "nope"], "EXPERIMENT/TRIAL"),
        (["stop", "a/b"], "no job a/b"),
        (["logs", "a/b"], "no job a/b"),
    ]
    for args, needle in cases:
        res = areal(*args)
        assert res.returncode == 2, (args, res.stderr)
        assert needle in res.stderr, (args, res.stderr)
        assert "Traceback" not in res.stderr, (args, res.stderr)


def test_config_file_and_unknown_key(model, tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"backend: hf\nmodel: {model}\nalloc: hf:d2\nexperiment: fromyaml\n")
    plan = json.loads(areal("serve", "--config", str(cfg), "--dry-run", "--json", check=0).stdout)
    assert plan["experiment"] == "fromyaml" and len(plan["processes"]) == 2
    cfg.write_text("modle: x\n")
    assert "unknown key 'modle'" in areal("serve", "--config", str(cfg), check=2).stderr
    cfg.write_text("model: [unclosed\n")
    assert "not valid YAML" in areal("serve", "--config", str(cfg), check=2).stderr


def test_api_key_auto_everywhere_in_the_environment_only_none_opts_out(model, areal_env):
    for host in ("0.0.0.0", "127.0.0.1"):
        plan = json.loads(
            areal(*fake_serve_args(model, "--host", host, "--dry-run", "--json"), check=0).stdout
        )
        proc = plan["processes"][0]
        assert plan["api_key"] == "<set>" and proc["env"]["AREAL_SERVER_API_KEY"] == "<api-key>"
        assert "--api-key" not in proc["argv"] and "<api-key>" not in proc["argv"]
    plan = json.loads(
        areal(*fake_serve_args(model, "--api-key", "none", "--dry-run", "--json"), check=0).stdout
    )
    assert plan["api_key"] is None and "AREAL_SERVER_API_KEY" not in plan["processes"][0]["env"]


def test_fake_script_python_is_used(model):
    plan = json.loads(areal(*fake_serve_args(model, "--dry-run", "--json"), check=0).stdout)
    assert plan["processes"][0]["argv"][0] == FAKE_PYTHON


def test_shipped_job_files_plan(model):
    from tests.helpers import REPO

    plan = json.loads(
        areal("serve", "--config", str(REPO / "templates/serve.yaml"), "--model", str(model),
              "--dry-run", "--json", env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, check=0).stdout
    )  # fmt: skip
    assert [p["gpus"] for p in plan["processes"]] == [[0], [1], [2], [3]]
    assert plan["processes"][0]["argv"][-2:] == ["--context-length", "8192"]
    plan = json.loads(
        areal("train", "--config", str(REPO / "templates/train.yaml"), "--dry-run", "--json",
              str(REPO / "templates/grpo/train.py"), env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"},
              check=0).stdout
    )  # fmt: skip
    assert plan["experiment"] == "grpo" and plan["processes"][0]["gpus"] == [0, 1, 2, 3]


def test_extra_backend_args_pass_through_and_debug_shows_traceback(model, tmp_path):
    plan = json.loads(
        areal(*fake_serve_args(model, "--dry-run", "--json", "--", "--max-total-tokens", "64"),
              check=0).stdout
    )  # fmt: skip
    assert plan["processes"][0]["argv"][-2:] == ["--max-total-tokens", "64"]
    res = areal("--debug", "serve", "--model", str(tmp_path / "nope"), check=2)
    assert "Traceback" in res.stderr and "does not exist" in res.stderr


def _record(home, name, host, pid, state, create_time):
    from areal_cli.schedulers.local import records as jobs

    exp, trial = name.split("/")
    rec = jobs.JobRecord(
        experiment=exp, trial=trial, kind="serve", state=state, marker="m-" + trial,
        supervisor_pid=pid, supervisor_create_time=create_time, host=host, started=time.time(),
        log_dir="/tmp", registry="/tmp",
        processes=[jobs.ProcessRecord(role="server", index=0, pid=pid, argv=[], log="",
                                      create_time=create_time)],
    )  # fmt: skip
    jobs.write(home, rec)


def test_stop_never_signals_pids_that_are_not_ours(areal_env):
    """A record from another host (shared home), or an old record whose pid was reused,
    must not get anyone killed."""
    home, _ = areal_env
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        _record(home, "remote/t", "othernode", sleeper.pid, "running", time.time())
        res = areal("stop", "remote/t", check=2)
        assert "runs on othernode" in res.stderr
        _record(home, "old/t", __import__("socket").gethostname(), sleeper.pid, "stopped", 1.0)
        areal("stop", "old/t", check=0)
        areal("stop", "--all", check=0)
        assert sleeper.poll() is None, "an unrelated process was killed"
    finally:
        sleeper.kill()
        sleeper.wait()


def test_bad_config_values_exit_2(model, tmp_path):
    cfg = tmp_path / "job.yaml"
    for text, needle in [
        ("seed: abc\n", "seed is 'abc'"),
        ("dp: two\n", "dp is 'two'"),
        ("extra_args: --foo\n", "not a list"),
        ("port_base: 99999\n", "not a port"),
    ]:
        cfg.write_text(f"model: {model}\n" + text)
        res = areal("serve", "--config", str(cfg), "--dry-run", check=2)
        assert needle in res.stderr and "Traceback" not in res.stderr, res.stderr
    cfg.write_text("nnodes: x\n")
    res = areal("train", "--config", str(cfg), "--alloc", "fsdp:d1", "x.py", check=2)
    assert "nnodes is 'x'" in res.stderr
    res = areal(*fake_serve_args(model, "--host", "nohost.invalid"), check=2)
    assert "does not resolve" in res.stderr
