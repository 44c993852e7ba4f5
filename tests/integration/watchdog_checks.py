"""What a watchdog verdict on a stalled two-node job looks like on every cluster scheduler:
the job of tests/fixtures/scripts/watchdog_job.py (rank 1 skips the last all_reduce) under
`--watchdog 4`, its `areal` gone. Slurm's and Ray's tests add what is theirs (nodes, files)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.helpers import areal, wait_for


def log_dir(home: Path) -> Path:
    found = list((home / "logs").glob("*/default/trial0"))
    assert len(found) == 1, list((home / "logs").rglob("*"))
    return found[0]


def assert_one_stall_verdict(home: Path, job_id: str, timeout: float) -> tuple[str, dict, Path]:
    """Wait for the verdict and check it where a user looks: watchdog.log (placing each rank
    by its flight recorder), the bundle, once per stall, `areal ps` and `areal logs`.
    Returns watchdog.log's text, the verdict and the bundle's folder."""

    def verdict() -> str | None:
        try:
            text = (log_dir(home) / "watchdog.log").read_text()
        except (OSError, AssertionError):
            return None
        return text if "verdict" in text else None

    text = wait_for(verdict, timeout, "no verdict", interval=0.2)
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
