"""Servers that heal: a replica's server that dies is started again by its runner on the
same address, registered again once it serves, counted in `areal ps`; its restarts have a
budget; a stop in the middle of one leaves nothing running. Stand-in servers
(tests/fixtures/fake_python.py) for the runner's side, real hf servers and a 2-rank gloo
trainer for the realignment."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import urllib.request
from pathlib import Path

import psutil
import pytest

from areal_cli import apikeys
from areal_cli.registry import FileRegistry
from areal_cli.schedulers.local import records
from tests.helpers import AREAL, REPO, areal, fake_serve_args, wait_for


@pytest.fixture
def model(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    return d


def _pids(pidfile) -> list[int]:
    text = pidfile.read_text() if pidfile.exists() else ""
    return [int(x) for line in text.splitlines() for x in line.split()]


def _job(name="default/trial0") -> dict:
    """The serving job of that name (a training job may share it)."""
    jobs = json.loads(areal("ps", "--all", "--json", check=0).stdout)
    return next(j for j in jobs if j["name"] == name and j["kind"] == "serve")


def _servers(name="default/trial0") -> list[dict]:
    return _job(name)["servers"]


def _logs(name="default/trial0") -> str:
    return areal("logs", name, "--role", "server", check=0).stdout


def _none_alive(pids) -> bool:
    return not any(
        psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids
    )


def _serve_detached(model, pidfile, *flags: str) -> list[dict]:
    """`areal serve --detach` of stand-in servers that write their pids (and their
    children's) to `pidfile`; the servers it reports."""
    out = areal(*fake_serve_args(model, *flags, "--detach", "--json"),
                env={"FAKE_SERVER_PIDFILE": str(pidfile)}, check=0)  # fmt: skip
    return json.loads(out.stdout)["servers"]


def _assert_nothing_left(pidfile, reg) -> None:
    """After `areal stop`: no server nor anything it started alive, and none registered."""
    wait_for(lambda: _none_alive(_pids(pidfile)), 10, "a server survived the stop")
    assert FileRegistry(reg).list().servers == []


def test_a_killed_server_comes_back_on_its_address_registered_and_counted(
    model, areal_env, tmp_path
):
    home, reg = areal_env
    pidfile = tmp_path / "pids"
    victim, other = _serve_detached(model, pidfile, "--alloc", "hf:d2")
    try:
        # Each server writes "pid child-pid"; the two servers start in either order.
        started = _pids(pidfile)
        dead = [victim["pid"], dict(zip(started[::2], started[1::2], strict=True))[victim["pid"]]]
        os.kill(victim["pid"], signal.SIGKILL)
        back = wait_for(
            lambda: [
                s
                for s in _servers()
                if s["addr"] == victim["addr"] and s["healthy"] and s.get("restarts") == 1
            ],  # fmt: skip
            30,
            "the killed server was never back with one restart",
        )[0]
        assert back["pid"] != victim["pid"]
        # In discovery again, at the same address, under a fresh entry; the other untouched.
        entries = {e.addr: e for e in FileRegistry(reg).list().servers}
        assert entries[victim["addr"]].restarts == 1 and entries[victim["addr"]].pid == back["pid"]
        assert entries[other["addr"]].restarts == 0 and entries[other["addr"]].pid == other["pid"]
        # What the dead server left (its grandchild) went before the new one started.
        wait_for(lambda: _none_alive(dead), 10, "the dead server's child survived")
        logs = _logs()
        assert "server exited (killed by SIGKILL); deregistered" in logs
        assert "restarting the server (restart 1, 2 more allowed within the hour)" in logs
        assert f"restart 1: registered {victim['addr']}" in logs
        table = areal("ps", check=0).stdout
        assert "restarts 1" in table
        assert _job()["state"] == "running"
    finally:
        areal("stop", "default/trial0", check=0)
    _assert_nothing_left(pidfile, reg)


def test_past_its_budget_a_replica_ends_as_before(model, areal_env, tmp_path):
    home, reg = areal_env
    pidfile = tmp_path / "pids"
    (server,) = _serve_detached(model, pidfile, "--max-restarts", "1")
    try:
        os.kill(server["pid"], signal.SIGKILL)
        again = wait_for(
            lambda: [s for s in _servers() if s["healthy"] and s.get("restarts") == 1],
            30,
            "never restarted",
        )[0]
        os.kill(again["pid"], signal.SIGKILL)
        wait_for(lambda: _job()["state"] == "failed", 30, "the job never ended")
        assert (
            "not restarted: 1 restart(s) within the last hour, the budget (--max-restarts 1)"
            in (_logs())
        )
        ended = json.dumps(_job())
        assert "server-0" in ended and "SIGKILL" in ended, ended
    finally:
        areal("stop", "default/trial0", check=0)
    _assert_nothing_left(pidfile, reg)


def test_max_restarts_0_turns_restarts_off_and_bad_values_exit_2(model, areal_env, tmp_path):
    pidfile = tmp_path / "pids"
    (server,) = _serve_detached(model, pidfile, "--max-restarts", "0")
    try:
        os.kill(server["pid"], signal.SIGKILL)
        wait_for(lambda: _job()["state"] == "failed", 30, "the job never ended")
        assert "restarting" not in _logs()
    finally:
        areal("stop", "default/trial0", check=0)
    _assert_nothing_left(pidfile, areal_env[1])
    bad = areal(*fake_serve_args(model, "--max-restarts", "-1", "--dry-run"), check=2)
    assert "Traceback" not in bad.stderr and "--max-restarts" in bad.stderr
    cfg = tmp_path / "job.yaml"
    cfg.write_text("max_restarts: -2\n")
    bad = areal(*fake_serve_args(model, "--config", str(cfg), "--dry-run"), check=2)
    assert "Traceback" not in bad.stderr and "max_restarts" in bad.stderr
    plan = json.loads(areal(*fake_serve_args(model, "--dry-run", "--json"), check=0).stdout)
    assert plan["server_restarts"] == 3  # on by default


def test_a_stop_during_a_restart_leaves_nothing_running(model, areal_env, tmp_path):
    home, reg = areal_env
    pidfile, starts = tmp_path / "pids", tmp_path / "starts"
    # The restarted server never becomes healthy: the stop comes while its runner waits.
    env = {**os.environ, "FAKE_REAL_PYTHON": os.sys.executable, "FAKE_SERVER_PIDFILE": str(pidfile),
           "FAKE_SERVER_STARTS": str(starts), "FAKE_RESTART_MODE": "never"}  # fmt: skip
    # In the foreground: the restart's line reaches the terminal of `areal serve` too.
    proc = subprocess.Popen([AREAL, *fake_serve_args(model)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_for(lambda: FileRegistry(reg).list().servers, 30, "never registered")
        (pid, _child) = _pids(pidfile)
        os.kill(pid, signal.SIGKILL)
        # The second start is running (its pid written) and not registered.
        wait_for(lambda: len(_pids(pidfile)) == 4, 30, "never restarted")
        assert FileRegistry(reg).list().servers == []
        areal("stop", "default/trial0", check=0)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert "restarting the server (restart 1" in err and "[server-0]" in err
    _assert_nothing_left(pidfile, reg)


STALLING_JOB = str(REPO / "tests" / "fixtures" / "scripts" / "watchdog_job.py")


def test_the_job_record_follows_a_restarted_server_to_ps_the_watchdog_and_the_stop(
    model, areal_env, tmp_path
):
    """After a restart the job record names the server that serves, not the first one: `areal
    ps` shows its pid, a stalled trainer's watchdog keeps its stack, `areal stop` ends it."""
    home, reg = areal_env
    pidfile = tmp_path / "pids"
    (first,) = _serve_detached(model, pidfile, "--alloc", "hf:d1")
    path = records.record_path(home, "default", "trial0", "serve")

    def recorded() -> dict:
        rec = json.loads(path.read_text())
        return next(p for p in rec["processes"] if p["role"] == "server")

    try:
        assert recorded()["server_pid"] == first["pid"]
        os.kill(first["pid"], signal.SIGKILL)  # the engine, not its runner
        back = wait_for(
            lambda: [s for s in _servers() if s["healthy"] and s.get("restarts") == 1],
            30,
            "never restarted",
        )[0]
        assert back["pid"] != first["pid"]
        wait_for(lambda: recorded()["server_pid"] == back["pid"], 30,
                 "the job record kept the first server's pid")  # fmt: skip
        (entry,) = FileRegistry(reg).list().servers
        assert recorded()["server_create_time"] == entry.pid_create_time
        pids = _job()["pids"]
        assert back["pid"] in pids and first["pid"] not in pids, pids
        where = areal("ps", check=0).stdout
        assert re.search(rf"pids\b[\d\s]*\b{back['pid']}\b", where), where
        # A trainer on these servers (found in the registry) stalls; its watchdog keeps the
        # stack of the server that serves now, by the pid the serving job's record holds.
        areal("train", "--alloc", "fsdp:d2", "--watchdog", "3", "--watchdog-action", "fail",
              STALLING_JOB, env={"STALL_RANK": "1", "STEPS": "3", "PLAIN": "1"}, timeout=240,
              check=1)  # fmt: skip
        train = next(j for j in json.loads(areal("ps", "--all", "--json", check=0).stdout)
                     if j["name"] == "default/trial0" and j["kind"] == "train")  # fmt: skip
        kept = sorted(x.name for x in (Path(train["watchdog"]["bundle"]) / "servers").iterdir())
        assert kept == [f"server-pid{back['pid']}.json"], kept
        assert _job()["state"] == "running"
    finally:
        areal("stop", "default/trial0", check=0)
    _assert_nothing_left(pidfile, reg)  # the restarted server's pid is in the file too


# -- the trainers' side: real hf servers, the GRPO example on two gloo ranks ----------------

TRAIN = str(REPO / "templates" / "grpo" / "train.py")
CONFIG = str(REPO / "templates" / "grpo" / "tiny_cpu.yaml")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from areal_cli.modelgen import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=0)


def _metrics_dir(home):
    return home / "logs" / os.environ.get("USER", "root") / "default" / "trial0"


def _metrics(home) -> list[dict]:
    path = _metrics_dir(home) / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def _weight_version(addr: str, key: str) -> str:
    req = urllib.request.Request(f"http://{addr}/model_info")
    req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["weight_version"]


def test_a_server_killed_mid_training_is_realigned_before_it_serves_again(tiny, areal_env):
    home, _ = areal_env
    out = areal("serve", "--backend", "hf", "--model", str(tiny), "--alloc", "hf:d2", "--detach",
                "--json", check=0, timeout=180)  # fmt: skip
    victim, _other = json.loads(out.stdout)["servers"]
    # Steps enough to outlast the restart (a tiny model's server starts in seconds, in half a
    # minute and more on a loaded host): the run is ended once the server served again.
    proc = subprocess.Popen(
        [AREAL, "train", "--alloc", "fsdp:d2", TRAIN, "--config", CONFIG, "steps=500"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip

    def sampled_again(after: int) -> list[dict]:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        rows = _metrics(home)[after:]
        return [r for r in rows if victim["addr"] in r["servers_sampled"]]

    try:
        wait_for(lambda: len(_metrics(home)) >= 2 or proc.poll() is not None, 300,
                 "training made no progress")  # fmt: skip
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        killed_after = len(_metrics(home))
        os.kill(victim["pid"], signal.SIGKILL)
        # Back in rotation: sampled again at a later step (and one more step after it).
        first = wait_for(lambda: sampled_again(killed_after), 600, "never sampled again")[0]
        wait_for(lambda: len(_metrics(home)) > first["step"] + 2, 300, "no step after it")
        key = json.loads(apikeys.key_file(home, "default", "trial0").read_text())["key"]
        rows = _metrics(home)
        # It holds the trainer's weights: a sync reached it before it served again.
        assert int(_weight_version(victim["addr"], key)) >= int(first["weight_version"])
        # No sample of its base weights: the gap between the servers' and the trainer's
        # logprobs stays where it was (a base-weights sample after training steps is far off).
        assert max(r["logprob_gap"] for r in rows) < 1e-3, [r["logprob_gap"] for r in rows]
        (back,) = [s for s in _servers() if s["addr"] == victim["addr"]]
        assert back["restarts"] == 1 and back["healthy"]
        # The trainer was told by discovery, and said so.
        rank0 = (_metrics_dir(home) / "rank-0.log").read_text()
        assert f"{victim['addr']} is listed again by another process (restarted)" in rank0
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        finally:
            proc.kill()
            areal("stop", "default/trial0", check=0, timeout=60)
