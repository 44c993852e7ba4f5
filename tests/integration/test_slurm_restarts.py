"""`areal train --scheduler slurm --max-restarts N` on the real two-node cluster of
tests/services.py: the batch script starts the torchrun step again inside the same allocation
when the doctor's root cause says a restart may pass, and stops at once on a bug that would
repeat. Nothing is left afterwards (the leak check, and no queued job)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

from tests.helpers import AREAL, REPO, areal, wait_for

SCRIPT = str(REPO / "tests" / "scenarios" / "restart_steps.py")
SLURM = ("--scheduler", "slurm", "--alloc", "fsdp:d2", "--gpus-per-node", "1", "--servers",
         "none", "--watchdog", "0")  # fmt: skip


def _script(scen, fail: str) -> list[str]:
    """The scenario, its folder and its failure (restart_steps.py's arguments)."""
    return [SCRIPT, str(scen), fail]


def _decisions(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.startswith(("restart ", "not restarting: "))]


def _job(name: str) -> dict:
    jobs = json.loads(areal("ps", "--all", "--json", check=0).stdout)
    return next(j for j in jobs if j["name"] == name)


def test_sigkilled_rank_restarts_in_the_same_allocation(slurm_env, tmp_path):
    scen = tmp_path / "scen"
    scen.mkdir()
    proc = subprocess.Popen(
        [AREAL, "train", *SLURM, "-e", "rs", "-t", "kill", "--max-restarts", "2",
         *_script(scen, "wait@3")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(
            lambda: (scen / "ready-1").exists() or proc.poll() is not None, 180, "rank 1 at step 3"
        )
        assert proc.poll() is None, proc.communicate()
        os.kill(int((scen / "pid-1").read_text()), signal.SIGKILL)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    (line,) = _decisions(err)
    assert line.startswith("restart 1/2: rank 1 killed by SIGKILL (signal)"), line
    for rank in (0, 1):
        assert (scen / f"runs-{rank}").read_text().splitlines() == ["- 1", "1 3"]
        assert (scen / f"step-{rank}").read_text() == "6"
    job = _job("rs/kill")
    assert job["state"] == "stopped" and job["exit_code"] == 0
    assert [r["line"] for r in job["restarts"]] == [line]
    # One allocation: the restart is a new step of the same Slurm job, said in its output.
    assert line in (Path(job["log_dir"]) / "supervisor-train.log").read_text()
    for rank in (0, 1):
        (job1, step1), (job2, step2) = [
            x.split() for x in (scen / f"slurm-{rank}").read_text().splitlines()
        ]
        assert job1 == job2 == job["job_id"] and step1 != step2


def test_deterministic_bug_is_not_retried(slurm_env, tmp_path):
    res = areal("train", *SLURM, "-e", "rs", "-t", "bug", "--max-restarts", "3",
                *_script(tmp_path, "value@3"), timeout=240)  # fmt: skip
    assert res.returncode == 1, res.stderr[-3000:]
    (line,) = _decisions(res.stderr)
    assert re.match(r"not restarting: rank \d ValueError: bad batch shape", line), line
    assert (tmp_path / "runs-0").read_text().splitlines() == ["- 1"]
    assert [r["line"] for r in _job("rs/bug")["restarts"]] == [line]
