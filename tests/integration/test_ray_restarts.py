"""`areal train --scheduler ray --max-restarts N` on the real two-node Ray cluster of
tests/ray_cluster.py: torchrun starts again in the same actors (the placement group kept)
when the doctor's root cause says a restart may pass; a bug that would repeat stops at once.
Nothing is left on Ray or the host afterwards."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess

import pytest

from tests.helpers import AREAL, REPO, areal, wait_for
from tests.integration.test_ray import marked, ray_left

SCRIPT = str(REPO / "tests" / "scenarios" / "restart_steps.py")
RAY = ("--scheduler", "ray", "--alloc", "fsdp:d2", "--nnodes", "2", "--servers", "none",
       "--watchdog", "0")  # fmt: skip

pytestmark = pytest.mark.usefixtures("ray_env")


def _script(scen, fail: str) -> list[str]:
    """The scenario, its folder and its failure (restart_steps.py's arguments)."""
    return [SCRIPT, str(scen), fail]


def _decisions(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.startswith(("restart ", "not restarting: "))]


def _job(name: str) -> dict:
    jobs = json.loads(areal("ps", "--all", "--json", check=0).stdout)
    return next(j for j in jobs if j["name"] == name)


def _nothing_left(cluster, marker: str) -> None:
    assert marked(marker) == []
    left = ray_left(cluster)
    assert not [a for a in left["actors"] if marker in a], left
    assert not [g for g in left["groups"] if marker in g], left


def test_sigkilled_rank_restarts_in_the_same_placement_group(ray_cluster, tmp_path):
    scen = tmp_path / "scen"
    scen.mkdir()
    proc = subprocess.Popen(
        [AREAL, "train", *RAY, "-e", "rs", "-t", "kill", "--max-restarts", "2",
         *_script(scen, "wait@3")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(
            lambda: (scen / "ready-1").exists() or proc.poll() is not None, 240, "rank 1 at step 3"
        )
        assert proc.poll() is None, proc.communicate()
        os.kill(int((scen / "pid-1").read_text()), signal.SIGKILL)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    (line,) = _decisions(err)
    assert line.startswith("restart 1/2: rank 1 killed by SIGKILL (signal)"), line
    for rank in (0, 1):
        assert (scen / f"runs-{rank}").read_text().splitlines() == ["- 1", "1 3"]
        assert (scen / f"step-{rank}").read_text() == "6"
    job = _job("rs/kill")
    assert job["state"] == "stopped" and job["exit_code"] == 0
    assert [r["line"] for r in job["restarts"]] == [line]
    _nothing_left(ray_cluster, job["marker"])


def test_deterministic_bug_is_not_retried(ray_cluster, tmp_path):
    res = areal("train", *RAY, "-e", "rs", "-t", "bug", "--max-restarts", "3",
                *_script(tmp_path, "value@3"), timeout=300)  # fmt: skip
    assert res.returncode == 1, res.stderr[-3000:]
    (line,) = _decisions(res.stderr)
    assert re.match(r"not restarting: rank \d ValueError: bad batch shape", line), line
    assert (tmp_path / "runs-0").read_text().splitlines() == ["- 1"]
    job = _job("rs/bug")
    assert [r["line"] for r in job["restarts"]] == [line]
    _nothing_left(ray_cluster, job["marker"])


def test_detached_restarts_are_refused_before_anything_starts(ray_cluster, tmp_path):
    res = areal("train", *RAY, "--max-restarts", "1", "--detach", SCRIPT, check=2, timeout=120)
    assert "--max-restarts on Ray needs the job in the foreground" in res.stderr
    assert "Traceback" not in res.stderr
