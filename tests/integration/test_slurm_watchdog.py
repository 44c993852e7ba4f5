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

from tests.helpers import AREAL, FAKE_PYTHON, REPO, areal
from tests.integration.test_slurm import assert_nothing_left, record, wait_for

SCRIPT = str(REPO / "tests" / "fixtures" / "scripts" / "watchdog_job.py")
TRAIN = ("train", "--scheduler", "slurm", "--alloc", "fsdp:d2", "--gpus-per-node", "1",
         "--servers", "none", "--watchdog", "4")  # fmt: skip
STALL = {"STALL_RANK": "1", "STEPS": "3"}


def _log_dir(home: Path) -> Path:
    found = list((home / "logs").glob("*/default/trial0"))
    assert found, list((home / "logs").rglob("*"))
    return found[0]


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

        def verdict() -> str | None:
            try:
                text = (_log_dir(home) / "watchdog.log").read_text()
            except (OSError, AssertionError):
                return None
            return text if "verdict" in text else None

        text = wait_for(verdict, 90, "no verdict", interval=0.2)
        took = time.monotonic() - started
        assert "stall: no rank progressed for 4s; verdict mismatched_collective (odd ranks 1)" in (
            text
        )
        # The flight recorders, asked on each rank's node, place every rank.
        assert "rank 0: collective #3 of group default_pg (all_reduce, scheduled)" in text
        assert "rank 1: collective #2 of group default_pg (all_reduce, completed)" in text
        bundle = Path(text.split("bundle ", 1)[1].split()[0])
        assert bundle.parent == _log_dir(home)
        stall = json.loads((bundle / "verdict.json").read_text())
        assert stall["kind"] == "mismatched_collective" and stall["odd_ranks"] == [1]
        assert stall["latency_s"] <= 4 + 10, stall
        summary = json.loads((bundle / "summary.json").read_text())
        assert {r["rank"]: r["node"] for r in summary["ranks"]} == {0: "n1", 1: "n2"}
        assert sorted(p.name for p in (bundle / "flight-recorder").glob("rank*.json")) == [
            "rank0.json", "rank1.json",
        ]  # fmt: skip
        assert {p.name.split("-pid")[0] for p in bundle.glob("rank*-pid*.json")} == {
            "rank0-n1", "rank1-n2",
        }  # fmt: skip
        tail = (bundle / "logs" / "rank-1.tail.log").read_text()
        assert "rank 1 skips the all_reduce of step 2" in tail
        # Once per stall: the job stays hung, no second verdict.
        time.sleep(6)
        assert (_log_dir(home) / "watchdog.log").read_text().count("stall:") == 1
        supervisor = (_log_dir(home) / "supervisor-train.log").read_text()
        assert "areal watchdog:" in supervisor and "mismatched_collective" in supervisor

        rows = json.loads(areal("ps", "--json", check=0).stdout)
        row = next(r for r in rows if r["job_id"] == job)
        assert row["state"] == "running" and row["watchdog"]["kind"] == "mismatched_collective"
        assert "stalled: mismatched_collective ranks 1" in areal("ps", check=0).stdout
        shown = areal("logs", "default/trial0", check=0).stdout
        assert "[watchdog]" in shown and "verdict mismatched_collective" in shown
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
    assert "error: watchdog: mismatched_collective (odd ranks 1): rank 0 waits in all_reduce" in err
    assert "no rank progressed for 4s" in err and "Traceback" not in err
    rec = record(home, "serve+train")
    job = rec["job_id"]
    assert rec["state"] == "failed" and rec["exit_code"] == 1
    assert rec["message"].startswith("watchdog: mismatched_collective (odd ranks 1)")
    bundle = Path(err.split("last log lines: ", 1)[1].split()[0])
    servers = [p.name for p in (bundle / "servers").iterdir()]
    assert len(servers) == 1 and servers[0].startswith("server-n1-pid"), servers
    assert servers[0].endswith(".json")
    why = areal("doctor", "why", "default/trial0", check=0).stdout
    assert "sent by: the watchdog (--watchdog-action fail)" in why
    assert_nothing_left(slurm_env, home, registry, job)
