"""The watchdog on a Ray training job, on the real two-node Ray cluster: it runs in the job's
first training actor (so a job whose `areal` is gone is watched), looks at each node's ranks
through the job's actor there, and on a stall runs the hang doctor on both nodes (stacks and
flight recorders) and keeps a bundle; the verdict lands where it does on Slurm (watchdog.log,
`areal logs`, `areal ps`, and with `--watchdog-action fail` the job's failure and `doctor
why`). One rank on each node (fsdp:d2 --nnodes 2); rank 1 skips the last all_reduce."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers import AREAL, REPO, areal, wait_for
from tests.integration.test_ray import marked, ray_left
from tests.integration.watchdog_checks import (
    assert_failed_with_the_verdict_first,
    assert_one_stall_verdict,
)

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

    wait_for(running, 120, "the job did not start", interval=0.3)
    proc.kill()  # the watchdog lives in the job, not in this areal
    proc.wait()
    rec = _record(home)
    try:
        _, stall, bundle = assert_one_stall_verdict(home, rec["job_id"], timeout=120)
        summary = json.loads((bundle / "summary.json").read_text())
        assert {r["node"] for r in summary["ranks"]} == set(ray_env.nodes)
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
    rec = _record(home)
    assert_failed_with_the_verdict_first(res.stderr, rec)
    assert "[watchdog]" in res.stdout + res.stderr  # the foreground shows it as it lands
    _assert_nothing_left(ray_env, reg, rec["marker"])
