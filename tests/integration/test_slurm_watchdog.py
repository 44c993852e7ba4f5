"""The watchdog on a Slurm training job, on the real two-node cluster: it runs inside the batch
job (so a detached job is watched), looks at each node's ranks by a short srun there, and on a
stall runs the hang doctor on every node (stacks and flight recorders) and keeps a bundle.
One rank on each node (fsdp:d2, --gpus-per-node 1); rank 1 skips the last all_reduce."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import AREAL, FAKE_PYTHON, areal, wait_for
from tests.integration.test_slurm import assert_nothing_left, record
from tests.integration.watchdog_checks import (
    SCRIPT,
    assert_failed_with_the_verdict_first,
    assert_one_stall_verdict,
    log_dir,
    wait_verdict,
)

TRAIN = ("train", "--scheduler", "slurm", "--alloc", "fsdp:d2", "--gpus-per-node", "1",
         "--servers", "none", "--watchdog", "4")  # fmt: skip
STALL = {"STALL_RANK": "1", "STEPS": "3"}


def test_a_stalled_two_node_job_gets_one_verdict_and_a_bundle_with_areal_gone(slurm_env, areal_env):
    """`areal train` is killed as soon as the job runs: the watchdog lives in the batch job."""
    home, registry = areal_env
    started = time.monotonic()
    proc = subprocess.Popen(
        [AREAL, *TRAIN, SCRIPT], env={**os.environ, **STALL},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip

    def running() -> bool:
        assert proc.poll() is None
        try:
            return record(home, "train")["state"] == "running"
        except OSError:
            return False

    wait_for(running, 60, "the job did not start")
    proc.kill()
    proc.wait()
    job = record(home, "train")["job_id"]
    try:
        text, stall, bundle = assert_one_stall_verdict(home, job, timeout=90)
        took = time.monotonic() - started
        summary = json.loads((bundle / "summary.json").read_text())
        assert {r["rank"]: r["node"] for r in summary["ranks"]} == {0: "n1", 1: "n2"}
        assert sorted(p.name for p in (bundle / "flight-recorder").glob("rank*.json")) == [
            "rank0.json", "rank1.json",
        ]  # fmt: skip
        assert {p.name.split("-pid")[0] for p in bundle.glob("rank*-pid*.json")} == {
            "rank0-n1", "rank1-n2",
        }  # fmt: skip
        supervisor = (log_dir(home) / "supervisor-train.log").read_text()
        assert "areal watchdog:" in supervisor and "mismatched_collective" in supervisor
        # doctor hang on the Slurm job joins each rank's flight recorder, fetched on its node.
        res = areal("doctor", "hang", "--job", "default/trial0", "--json", timeout=120)
        report = json.loads(res.stdout)
        assert report["flight"] == {"ranks": [0, 1], "errors": {}, "torch_analysis": []}, report
        text = areal("doctor", "hang", "--job", "default/trial0", timeout=120).stdout
        assert "collective #3" in text and "collective #2" in text, text
        print(f"\nSlurm watchdog: verdict {stall['latency_s']:.1f}s after the last progress "
              f"(--watchdog 4), {took:.1f}s from submission")  # fmt: skip
    finally:
        areal("stop", "default/trial0", check=0)
    assert_nothing_left(slurm_env, home, registry, job)


def test_fail_mode_ends_the_stalled_job_and_exits_1_with_the_verdict_first(slurm_env, areal_env):
    """Servers and trainers in one job (a stand-in server on one node, both ranks on the
    other): the server's stack, taken on its node, is in the bundle too."""
    home, registry = areal_env
    proc = subprocess.run(
        [AREAL, "train", "--scheduler", "slurm", "--alloc", "hf:d1+fsdp:d2", "--gpus-per-node",
         "2", "--model", "org/tiny", "--python", FAKE_PYTHON, "--watchdog", "4",
         "--watchdog-action", "fail", SCRIPT],
        env={**os.environ, **STALL, "COLUMNS": "200", "FAKE_REAL_PYTHON": sys.executable},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = proc.stderr
    rec = record(home, "serve+train")
    assert_failed_with_the_verdict_first(err, rec)
    assert "error: watchdog: mismatched_collective (odd ranks 1): rank 0 waits in all_reduce" in err
    bundle = Path(err.split("last log lines: ", 1)[1].split()[0])
    servers = [p.name for p in (bundle / "servers").iterdir()]
    assert len(servers) == 1 and servers[0].startswith("server-n1-pid"), servers
    assert servers[0].endswith(".json")
    assert_nothing_left(slurm_env, home, registry, rec["job_id"])


def test_auto_follows_the_step_time_in_the_batch_job(slurm_env, areal_env):
    """No --watchdog: auto, decided by the watcher in the batch job from the step times the
    ranks report on their nodes. Steps of 0.3 s, then the hang: the floor (20 s) applies."""
    from areal_cli.diagnose import watchdog

    home, registry = areal_env
    proc = subprocess.run(
        [AREAL, *TRAIN[:-2], "--detach", SCRIPT],
        env={**os.environ, "STALL_RANK": "1", "STEPS": "10", "STEP_S": "0.3"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    job = record(home, "train")["job_id"]
    try:
        text = wait_verdict(home, 180)
        line = f"no rank progressed for {watchdog.FLOOR:g}s (auto: 10x the median step"
        assert line in text and "verdict mismatched_collective (odd ranks 1)" in text, text
        stall = json.loads((Path(text.split("bundle ", 1)[1].split()[0]) / "verdict.json")
                           .read_text())  # fmt: skip
        assert stall["limit_s"] == watchdog.FLOOR and stall["idle_s"] >= stall["limit_s"]
        assert stall["latency_s"] <= stall["limit_s"] + 10, stall
    finally:
        areal("stop", "default/trial0", check=0)
    assert_nothing_left(slurm_env, home, registry, job)
