"""`areal doctor why E/T` on real torchrun jobs (gloo, CPU) started by `areal train`: the rank
that died first and how, its peers' errors secondary; and `areal train`'s own report."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

from tests.helpers import AREAL, REPO, areal, fake_serve_args

SCRIPT = str(REPO / "tests" / "fixtures" / "scripts" / "die.py")
RAISE_LINE = next(i for i, x in enumerate(open(SCRIPT), 1) if "raise ValueError" in x)


def train(mode: str, tmp_path, check: int = 1, **env):
    return areal("train", "--alloc", "fsdp:d2", "--servers", "none", SCRIPT,
                 env={"DIE": mode, "RECORD_DIR": str(tmp_path), **env},
                 check=check, timeout=120)  # fmt: skip


def why(name: str = "default/trial0") -> dict:
    return json.loads(areal("doctor", "why", name, "--json", check=0).stdout)


def log_dir() -> str:
    rec = json.loads(areal("ps", "--all", "--json", check=0).stdout)
    return next(j["log_dir"] for j in rec if j["kind"] != "serve")


def test_a_rank_that_raises_is_the_root_and_its_peers_lost_connection_secondary(tmp_path):
    res = train("raise", tmp_path)
    # areal train's own report: the same verdict.
    assert "rank-1 failed" in res.stderr
    assert "python_exception: ValueError: bad batch 1 on purpose" in res.stderr
    assert "die.py:" in res.stderr
    out = why()
    root = out["root_cause"]
    assert (root["rank"], root["kind"], root["source"]) == (1, "python_exception", "rank-1")
    assert root["where"] == f"{SCRIPT}:{RAISE_LINE}"  # the user's line, not torch's
    assert root["message"] == "ValueError: bad batch 1 on purpose"
    peer = [e for e in out["secondary"] if e["rank"] == 0]
    assert peer and peer[0]["kind"] == "connection_lost"
    assert peer[0]["caused_by"].startswith("rank 1: python_exception")
    assert any(e["kind"] == "child_failed" for e in out["secondary"])
    # The same files read as logs from anywhere give the same verdict.
    d = log_dir()
    files = sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".log"))
    out = json.loads(areal("doctor", "why", "--log", *files, "--json", check=0).stdout)
    assert (out["root_cause"]["rank"], out["root_cause"]["kind"]) == (1, "python_exception")


def test_a_collective_size_mismatch_is_named(tmp_path):
    res = train("mismatch", tmp_path)
    assert "collective_mismatch" in res.stderr
    out = why()
    root = out["root_cause"]
    assert root["kind"] == "collective_mismatch"
    assert "Received data size doesn't match" in root["message"]
    text = open(os.path.join(log_dir(), f"rank-{root['rank']}.log")).read()
    assert "Received data size doesn't match" in text
    other = 1 - root["rank"]
    assert any(e["rank"] == other and e["kind"] == "connection_lost" for e in out["secondary"])


def test_a_rank_killed_with_sigkill_is_the_root(tmp_path):
    res = train("sigkill", tmp_path)
    assert "rank-1 failed" in res.stderr and "killed by SIGKILL" in res.stderr
    out = why()
    root = out["root_cause"]
    assert (root["rank"], root["exit_code"]) == (1, -9)
    # Nothing in the kernel's log names it (dmesg readable here or not): a signal.
    assert root["kind"] in ("signal", "oom_killer")
    if root["kind"] == "signal":
        assert root["sender"].startswith("someone outside the job")
    assert all(e["rank"] != 1 or e["kind"] != "python_exception" for e in out["secondary"])
    # Rank 0 loses its connection, unless torchrun's SIGTERM comes first (a loaded machine):
    # whatever it got to print is a consequence.
    assert all(e["kind"] in ("connection_lost", "python_exception", "child_failed")
               for e in out["secondary"] if e["rank"] == 0)  # fmt: skip


def test_a_rank_out_of_cpu_memory_points_to_doctor_memory(tmp_path):
    res = train("cpu_oom", tmp_path)
    assert "rank-1 failed" in res.stderr and "cpu_oom: RuntimeError" in res.stderr
    assert "areal doctor memory" in res.stderr
    root = why()["root_cause"]
    assert (root["rank"], root["kind"]) == (1, "cpu_oom")
    assert "DefaultCPUAllocator: can't allocate memory" in root["message"]
    assert root["where"].startswith(SCRIPT) and "areal doctor memory" in root["hint"]


def test_a_server_killed_is_server_died(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    pids = tmp_path / "pids"
    env = {"FAKE_SERVER_PIDFILE": str(pids)}
    # Not restarted: the server's death ends the job.
    areal(*fake_serve_args(model, "--alloc", "hf:d1", "--max-restarts", "0", "--detach"), env=env,
          check=0)  # fmt: skip
    os.kill(int(pids.read_text().split()[0]), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while json.loads(areal("ps", "--all", "--json", check=0).stdout)[0]["state"] != "failed":
        assert time.monotonic() < deadline, "the serving job never ended"
        time.sleep(0.2)
    root = why()["root_cause"]
    assert (root["kind"], root["source"], root["exit_code"]) == ("server_died", "server-0", 137)
    assert "killed by SIGKILL" in root["message"] and root["path"].endswith("server-0.log")


def test_areal_stop_mid_run_is_the_root(tmp_path):
    env = {**os.environ, "DIE": "stop", "RECORD_DIR": str(tmp_path)}
    proc = subprocess.Popen([AREAL, "train", "--alloc", "fsdp:d2", "--servers", "none", SCRIPT],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("ready-*"))) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
        # Still running: that is the hang doctor's job.
        res = areal("doctor", "why", "default/trial0", check=2)
        assert "still running" in res.stderr and "areal doctor hang" in res.stderr
        areal("stop", "default/trial0", check=0)
        assert proc.wait(timeout=30) == 143
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    out = why()
    root = out["root_cause"]
    assert (root["kind"], root["sender"], root["rank"]) == ("signal", "areal stop", None)
    assert root["source"] == "job record"


def test_across_nodes_on_slurm_the_rank_on_the_second_node_is_named(slurm_env, tmp_path):
    """A two-node Slurm job (two ranks per node) whose last rank raises: `areal train` names
    it and its node, and `areal doctor why` reads every node's logs to the same verdict."""
    res = areal("train", "--scheduler", "slurm", "--alloc", "fsdp:d4", "--gpus-per-node", "2",
                "--servers", "none", SCRIPT, env={"DIE": "raise", "DIE_RANK": "3"},
                check=1, timeout=240)  # fmt: skip
    assert re.search(r"rank-3( on node n\d)? failed", res.stderr), res.stderr[-3000:]
    assert "python_exception: ValueError: bad batch 1 on purpose" in res.stderr
    out = why()
    root = out["root_cause"]
    assert (root["rank"], root["kind"]) == (3, "python_exception")
    # Its node is the one whose torchrun reported it, where Slurm let that torchrun report
    # before ending the step (it may end it first: then no node is named).
    if root.get("node"):
        assert root["node"] in ("n1", "n2")
    assert root["where"] == f"{SCRIPT}:{RAISE_LINE}"
    peers = {e["rank"] for e in out["secondary"] if e["kind"] == "connection_lost"}
    assert peers and 3 not in peers
    assert any(p.endswith(".log") and "torchrun-" in p for p in out["sources"])


def test_running_the_same_trial_again_shows_every_line_of_the_new_run(tmp_path):
    """The second run's logs replace the first's (new files, often with the old inodes):
    the terminal shows each of its lines once, and none of the first run's."""
    for run in ("first", "second"):
        res = train("none", tmp_path, check=0, LINES="100", RUN=run)
        for r in (0, 1):
            got = [x for x in res.stderr.splitlines() if x.startswith(f"[rank-{r}] rank {r} line ")]
            assert got == [f"[rank-{r}] rank {r} line {i}" for i in range(100)], (run, got[:3])
