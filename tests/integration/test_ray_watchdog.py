"""The watchdog on a Ray training job, on the real two-node Ray cluster: it runs in the job's
first training actor (so a job whose `areal` is gone is watched), looks at each node's ranks
through the job's actor there, and on a stall runs the hang doctor on both nodes (stacks and
flight recorders) and keeps a bundle; the verdict lands where it does on Slurm (watchdog.log,
`areal logs`, `areal ps`, and with `--watchdog-action fail` the job's failure and `doctor
why`). One rank on each node (fsdp:d2 --nnodes 2); rank 1 skips the last all_reduce."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import AREAL, REPO, areal
from tests.integration.test_ray import marked, ray_left

pytestmark = pytest.mark.usefixtures("ray_env")

JOB = REPO / "tests" / "fixtures" / "scripts" / "watchdog_job.py"
TRAIN = ("train", "--scheduler", "ray", "--alloc", "fsdp:d2", "--nnodes", "2",
         "--servers", "none", "--watchdog", "4")  # fmt: skip


def _script(tmp_path: Path) -> str:
    """watchdog_job.py with its stall set: Ray's workers get the node's environment, not the
    test's (only areal's own and torch's variables travel with the job)."""
    path = tmp_path / "stall_job.py"
    path.write_text(
        "import os, runpy\n"
        "os.environ.update(STALL_RANK='1', STEPS='3')\n"
        f"runpy.run_path({str(JOB)!r}, run_name='__main__')\n"
    )
    return str(path)


def _record(home: Path) -> dict:
    (path,) = (home / "ray").rglob("train.json")
    return json.loads(path.read_text())


def _log_dir(home: Path) -> Path:
    (found,) = (home / "logs").glob("*/default/trial0")
    return found


def _wait(what, timeout: float, message: str, interval: float = 0.3):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(interval)
    raise AssertionError(message)


def _assert_nothing_left(cluster, reg: Path, marker: str) -> None:
    from areal_cli.registry import open_registry

    assert marked(marker) == []
    left = ray_left(cluster)
    assert not [a for a in left["actors"] if a.startswith(marker)]
    assert not [g for g in left["groups"] if g.startswith(marker)]
    assert open_registry(str(reg)).ranks("default", "trial0") == []


def test_a_stalled_two_node_job_gets_one_verdict_with_areal_gone(ray_env, areal_env, tmp_path):
    home, reg = areal_env
    proc = subprocess.Popen([AREAL, *TRAIN, _script(tmp_path)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip

    def running() -> bool:
        assert proc.poll() is None
        try:
            return _record(home)["state"] == "running"
        except (OSError, ValueError):
            return False

    _wait(running, 120, "the job did not start")
    proc.kill()  # the watchdog lives in the job, not in this areal
    proc.wait()
    rec = _record(home)
    try:

        def verdict() -> str | None:
            try:
                text = (_log_dir(home) / "watchdog.log").read_text()
            except (OSError, ValueError):
                return None
            return text if "verdict" in text else None

        text = _wait(verdict, 120, "no verdict", interval=0.2)
        assert "stall: no rank progressed for 4s; verdict mismatched_collective (odd ranks 1)" in (
            text
        )
        # Each rank's flight recorder, asked on its own node, places it.
        assert "rank 0: collective #3 of group default_pg (all_reduce, scheduled)" in text
        assert "rank 1: collective #2 of group default_pg (all_reduce, completed)" in text
        bundle = Path(text.split("bundle ", 1)[1].split()[0])
        assert bundle.parent == _log_dir(home)
        stall = json.loads((bundle / "verdict.json").read_text())
        assert stall["kind"] == "mismatched_collective" and stall["odd_ranks"] == [1]
        assert stall["latency_s"] <= 4 + 10, stall
        summary = json.loads((bundle / "summary.json").read_text())
        assert {r["node"] for r in summary["ranks"]} == set(ray_env.nodes)
        assert (
            "rank 1 skips the all_reduce of step 2"
            in (bundle / "logs" / "rank-1.tail.log").read_text()
        )
        time.sleep(6)  # once per stall: the job stays hung, no second verdict
        assert (_log_dir(home) / "watchdog.log").read_text().count("stall:") == 1

        rows = json.loads(areal("ps", "--json", check=0).stdout)
        row = next(r for r in rows if r["job_id"] == rec["job_id"])
        assert row["state"] == "running" and row["watchdog"]["kind"] == "mismatched_collective"
        assert "stalled: mismatched_collective ranks 1" in areal("ps", check=0).stdout
        shown = areal("logs", "default/trial0", check=0).stdout
        assert "[watchdog]" in shown and "verdict mismatched_collective" in shown
        print(f"\nRay watchdog: verdict {stall['latency_s']:.1f}s after the last progress "
              f"(--watchdog 4)")  # fmt: skip
    finally:
        areal("stop", "default/trial0", check=0, timeout=120)
    _assert_nothing_left(ray_env, reg, rec["marker"])


def test_fail_mode_ends_the_stalled_job_and_exits_1_with_the_verdict_first(
    ray_env, areal_env, tmp_path
):
    home, reg = areal_env
    res = areal(*TRAIN, "--watchdog-action", "fail", _script(tmp_path), timeout=240)
    assert res.returncode == 1, res.stderr[-3000:]
    err = res.stderr
    assert "error: watchdog: mismatched_collective (odd ranks 1)" in err, err[-3000:]
    assert "no rank progressed for 4s" in err and "Traceback" not in err
    assert "[watchdog]" in res.stdout + err  # the foreground shows the verdict as it lands
    rec = _record(home)
    assert rec["state"] == "failed" and rec["exit_code"] == 1
    assert rec["message"].startswith("watchdog: mismatched_collective (odd ranks 1)")
    why = areal("doctor", "why", "default/trial0", check=0, timeout=120).stdout
    assert "sent by: the watchdog (--watchdog-action fail)" in why, why
    _assert_nothing_left(ray_env, reg, rec["marker"])
