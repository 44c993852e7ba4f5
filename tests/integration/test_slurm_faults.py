"""Faults of a Slurm cluster under running jobs. A node dies, on a cluster of the test's own:
first its slurmd only (the doctor cannot reach the node: it names it and judges from the
other), then the node itself (`areal train` names the node and the ranks that ran there).
On the shared cluster: a hung slurmctld (SIGSTOP) ends nothing and every command that asks it
exits 3; a pending job stopped under a waiting `areal serve --detach`; one replica's step
cancelled alone."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from areal_cli.registry import open_registry
from tests.helpers import AREAL, FAKE_PYTHON, areal

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


# ----------------------------------------------------------------- on the shared cluster

SLURM = ("--scheduler", "slurm")
FAKE = ("--backend", "hf", "--model", "org/tiny", "--python", FAKE_PYTHON)


@pytest.fixture
def fake_env(monkeypatch):
    monkeypatch.setenv("FAKE_REAL_PYTHON", sys.executable)


def _record(home: Path, trial: str = "trial0") -> dict:
    user = os.environ.get("USER", "root")
    return json.loads((home / "slurm" / user / "default" / trial / "serve.json").read_text())


def _gen_servers(registry: Path) -> list[str]:
    """What AReaL's name_resolve reader lists: folders holding one ENTRY under gen_servers."""
    user = os.environ.get("USER", "root")
    base = registry / user / "default" / "trial0" / "gen_servers"
    return sorted(p.parent.name for p in base.glob("*/ENTRY"))


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (got := pred()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return got


def test_a_hung_controller_ends_nothing_and_every_command_exits_3(
    private_slurm_cluster, areal_env, fake_env, monkeypatch, tmp_path
):
    # A controller of this test's own: stopping the shared one would stall the Slurm tests
    # that other workers run meanwhile.
    slurm_env = private_slurm_cluster
    for key, value in slurm_env.env.items():
        monkeypatch.setenv(key, value)
    home, registry = areal_env
    res = areal("serve", *SLURM, *FAKE, "--alloc", "hf:d2", "--detach", "--json", timeout=120)
    assert res.returncode == 0, res.stderr
    job = json.loads(res.stdout)["job_id"]
    servers = [p for p in psutil.process_iter() if _in_job(p, job)]
    entries = _gen_servers(registry)
    assert len(entries) == 2
    monkeypatch.setenv("AREAL_SLURM_TIMEOUT", "1.5")
    from areal_cli.schedulers.slurm import cluster

    script = tmp_path / "late.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH --job-name=areal-late-probe\n#SBATCH --output=/dev/null\n"
    )
    took = {}
    try:
        with slurm_env.controller_stopped():
            for what, args in (
                ("ps", ("ps",)),
                ("stop", ("stop", "default/trial0")),
                ("logs", ("logs", "-f", "default/trial0")),
                ("serve", ("serve", *SLURM, *FAKE, "--trial", "other", "--detach")),
            ):
                t0 = time.monotonic()
                res = areal(*args, check=None, timeout=60)
                took[what] = time.monotonic() - t0
                assert res.returncode == 3, (what, res.stdout, res.stderr)
                assert re.search(r"slurmctld at \S+ did not answer", res.stderr), (what, res.stderr)
                assert "Traceback" not in res.stderr
            t0 = time.monotonic()
            with pytest.raises(cluster.Unreachable) as got:
                cluster.sbatch(str(script), "areal-late-probe")
            took["sbatch"] = time.monotonic() - t0
            assert got.value.exit_code == 3
            assert "scancel --me --name=areal-late-probe" in got.value.message
            # Nothing was touched meanwhile: the record, the registry, the servers.
            rec = _record(home)
            assert rec["state"] == "running" and rec["message"] is None, rec
            assert _gen_servers(registry) == entries
            assert all(p.is_running() for p in servers)
    finally:
        # The request sbatch sent reaches the controller once it runs again.
        slurm_env.run("scancel", "--name=areal-late-probe", check=False)
    print("seconds per command with the controller stopped:", took)
    assert all(t < 10 for t in took.values()), took
    assert slurm_env.job_state(job) == "RUNNING"
    res = areal("ps", "--json", check=0, timeout=60)
    (row,) = json.loads(res.stdout)
    assert row["state"] == "running" and len(row["servers"]) == 2
    res = areal("stop", "default/trial0", check=0, timeout=60)
    assert "stopped (Slurm job" in res.stdout
    assert _gen_servers(registry) == []


def _in_job(p: psutil.Process, job: str) -> bool:
    try:
        return p.environ().get("SLURM_JOB_ID") == job and "fake_python" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def test_stopping_a_pending_job_ends_a_waiting_detached_serve_without_a_traceback(
    slurm_env, areal_env, fake_env
):
    home, _ = areal_env
    proc = subprocess.Popen(
        [AREAL, "serve", *SLURM, *FAKE, "--slurm-arg=--hold", "--health-timeout", "60",
         "--detach"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:

        def pending() -> bool:
            assert proc.poll() is None, proc.communicate()
            try:
                return _record(home)["state"] == "pending"
            except OSError:
                return False

        _wait(pending, 60, "the job was not submitted")
        job = _record(home)["job_id"]
        t0 = time.monotonic()
        res = areal("stop", "default/trial0", check=0, timeout=60)
        _, err = proc.communicate(timeout=60)
        print(f"detached serve ended {time.monotonic() - t0:.2f}s after areal stop began")
        assert "stopped" in res.stdout
        assert proc.returncode == 143, err
        assert "stopped default/trial0 before it was ready (areal stop)" in err
        assert "Traceback" not in err and "Stopped" not in err
        assert slurm_env.job_state(job) in ("CANCELLED", "")
    finally:
        if proc.poll() is None:
            proc.kill()
            areal("stop", "default/trial0", timeout=60)


def test_one_replica_step_cancelled_alone_is_shown_dead_and_leaves_discovery(
    slurm_env, areal_env, fake_env
):
    home, registry = areal_env
    res = areal("serve", *SLURM, *FAKE, "--alloc", "hf:d2", "--detach", "--json", timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    try:
        reg = open_registry(registry)
        victim = next(e for e in reg.list("default", "trial0").servers if e.node == "n2")
        assert "." in (victim.scheduler_job_id or ""), victim
        index = [s["addr"] for s in out["servers"]].index(victim.addr)
        t0 = time.monotonic()
        slurm_env.run("scancel", victim.scheduler_job_id)

        def shown_dead():
            (row,) = json.loads(areal("ps", "--json", check=0).stdout)
            dead = [s for s in row["servers"] if s["exit_code"] is not None]
            return row if dead else None

        row = _wait(shown_dead, 30, "ps never showed the cancelled replica dead")
        took = time.monotonic() - t0
        print(f"replica shown dead and out of discovery {took:.2f}s after scancel")
        assert row["state"] == "running", row
        assert f"server-{index} ended (killed by SIGKILL)" in row["reason"], row
        by_addr = {s["addr"]: s for s in row["servers"]}
        assert by_addr[victim.addr]["healthy"] is False
        assert victim.addr.replace(":", "_") not in _gen_servers(registry)
        assert len(_gen_servers(registry)) == 1
        assert victim.addr not in [e.addr for e in reg.list(include_dead=True).servers]
        table = areal("ps", check=0).stdout
        assert "starting" not in table and "✗" in table, table
    finally:
        areal("stop", "default/trial0", timeout=60)
    assert slurm_env.job_state(out["job_id"]) in ("CANCELLED", "COMPLETED", "")
