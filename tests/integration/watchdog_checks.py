"""What a watchdog verdict on a stalled two-node job looks like on every cluster scheduler:
the job of tests/fixtures/scripts/watchdog_job.py (rank 1 skips the last all_reduce) under
`--watchdog 4`, its `areal` gone. Slurm's and Ray's tests add what is theirs (nodes, files).
Also the local tests' way to run that job under `areal train` and wait for its verdict."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import AREAL, REPO, areal, wait_for

SCRIPT = str(REPO / "tests" / "fixtures" / "scripts" / "watchdog_job.py")


def log_dir(home: Path, trial: str = "trial0") -> Path:
    found = list((home / "logs").glob(f"*/default/{trial}"))
    assert len(found) == 1, list((home / "logs").rglob("*"))
    return found[0]


def train(trial: str, *flags: str, env: dict, alloc=("--servers", "none")) -> subprocess.Popen:
    """`areal train` of the job on this host, in its own session (stop() ends all of it)."""
    argv = [AREAL, "train", "--alloc", "fsdp:d2", *alloc, "--trial", trial, *flags, SCRIPT]
    return subprocess.Popen(
        argv,
        # One thread a rank: the two gloo ranks share a loaded 2-core machine.
        env={
            **os.environ,
            "COLUMNS": "200",
            "FAKE_REAL_PYTHON": sys.executable,
            "OMP_NUM_THREADS": "1",
            **env,
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def stop(p: subprocess.Popen) -> None:
    """Ctrl-C to a train() job, as a user stops it; its supervisor tears the ranks down."""
    os.killpg(p.pid, signal.SIGINT)
    p.communicate(timeout=60)


def wait_verdict(
    home: Path, timeout: float, trial: str = "trial0", job: subprocess.Popen | None = None
) -> str:
    """watchdog.log's text once it holds a verdict. With `job` (a train() job), its exit
    before then fails at once, with its output."""

    def verdict() -> str | None:
        if job is not None:
            assert job.poll() is None, job.communicate()
        try:
            text = (log_dir(home, trial) / "watchdog.log").read_text()
        except (OSError, AssertionError):
            return None
        return text if "verdict" in text else None

    return wait_for(verdict, timeout, "no verdict", interval=0.2)


def assert_one_stall_verdict(home: Path, job_id: str, timeout: float) -> tuple[str, dict, Path]:
    """Wait for the verdict and check it where a user looks: watchdog.log (placing each rank
    by its flight recorder), the bundle, once per stall, `areal ps` and `areal logs`.
    Returns watchdog.log's text, the verdict and the bundle's folder."""
    text = wait_verdict(home, timeout)
    assert "stall: no rank progressed for 4s; verdict mismatched_collective (odd ranks 1)" in text
    # Each rank's flight recorder, asked on its own node, places it.
    assert "rank 0: collective #3 of group default_pg (all_reduce, scheduled)" in text
    assert "rank 1: collective #2 of group default_pg (all_reduce, completed)" in text
    bundle = Path(text.split("bundle ", 1)[1].split()[0])
    assert bundle.parent == log_dir(home)
    stall = json.loads((bundle / "verdict.json").read_text())
    assert stall["kind"] == "mismatched_collective" and stall["odd_ranks"] == [1]
    assert stall["latency_s"] <= 4 + 10, stall
    tail = (bundle / "logs" / "rank-1.tail.log").read_text()
    assert "rank 1 skips the all_reduce of step 2" in tail
    time.sleep(6)  # once per stall: the job stays hung, no second verdict
    assert (log_dir(home) / "watchdog.log").read_text().count("stall:") == 1

    rows = json.loads(areal("ps", "--json", check=0).stdout)
    row = next(r for r in rows if r["job_id"] == job_id)
    assert row["state"] == "running" and row["watchdog"]["kind"] == "mismatched_collective"
    assert "stalled: mismatched_collective ranks 1" in areal("ps", check=0).stdout
    shown = areal("logs", "default/trial0", check=0).stdout
    assert "[watchdog]" in shown and "verdict mismatched_collective" in shown
    return text, stall, bundle


def assert_failed_with_the_verdict_first(err: str, rec: dict) -> None:
    """`--watchdog-action fail`: exit 1, the verdict leading the error, and the job's record."""
    assert "error: watchdog: mismatched_collective (odd ranks 1)" in err, err[-3000:]
    assert "no rank progressed for 4s" in err and "Traceback" not in err
    assert rec["state"] == "failed" and rec["exit_code"] == 1
    assert rec["message"].startswith("watchdog: mismatched_collective (odd ranks 1)")
    why = areal("doctor", "why", "default/trial0", check=0, timeout=120).stdout
    assert "sent by: the watchdog (--watchdog-action fail)" in why, why
