"""`areal doctor diverge` on jobs it cannot check: a rank stopped with SIGSTOP (named, with how
to resume it, within one --timeout) and a job whose ranks watch no model (a bad target,
exit 2, not the mismatch's exit 1). Real torchrun jobs (gloo on CPU) on the worker runtime."""

from __future__ import annotations

import os
import signal

import psutil
import pytest
from test_doctor_hang import launch, stop_all
from test_doctor_more import areal, home_of, reports

from areal_cli import procs
from areal_cli.worker import channel


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("diverge-faults")
    started = {}
    try:
        started["stoppable"] = launch("diverge_job", 2, tmp, env={"MODE": "replicated"},
                                      label="stoppable")  # fmt: skip
        started["blind"] = launch("diverge_job", 2, tmp, label="blind",
                                  env={"MODE": "replicated", "NO_WATCH": "1"})  # fmt: skip
        for s in started.values():
            s.wait_alive()
        yield started
    finally:
        stop_all(started.values())


def rank_pid(s, rank: int) -> int:
    for pid in s.rank_pids():
        if psutil.Process(pid).environ().get("RANK") == str(rank):
            return pid
    raise AssertionError(f"no rank {rank} under {s.proc.pid}")


def steps_on(s) -> bool:
    """The job still steps: each rank's step moves past what it was."""
    home = home_of(s)
    before = {p: channel.ask(p, "progress", home=home)["count"] for p in s.rank_pids()}

    def moved() -> bool:
        return all(channel.ask(p, "progress", home=home)["count"] > n for p, n in before.items())

    return procs.wait_until(moved, 60, cap=0.1)


def test_a_stopped_rank_is_named_with_how_to_resume_it(jobs):
    s = jobs["stoppable"]
    reports(s)
    pid = rank_pid(s, 1)
    os.kill(pid, signal.SIGSTOP)
    try:
        res = areal("diverge", "--pid", str(s.proc.pid), "--timeout", "3", home=home_of(s))
    finally:
        os.kill(pid, signal.SIGCONT)
    assert res.returncode == 2, res.stdout + res.stderr
    said = " ".join(res.stderr.split())
    assert "rank(s) [1] of" in said and f"(pid {pid}) are stopped (state T)" in said, said
    assert f"kill -CONT {pid}" in said
    assert "worker runtime" not in said and "Traceback" not in said
    assert steps_on(s)  # resumed, the job goes on


def test_a_job_that_watches_no_model_is_a_bad_target_not_a_mismatch(jobs):
    s = jobs["blind"]
    reports(s)
    res = areal("diverge", "--pid", str(s.proc.pid), "--timeout", "30", home=home_of(s))
    assert res.returncode == 2, res.stdout + res.stderr
    said = " ".join(res.stderr.split())
    assert "rank(s) [0, 1] of" in said and "watch no model" in said, said
    assert "areal_cli.worker.watch(model, optimizer)" in said
    assert "Traceback" not in said
    assert steps_on(s)  # the step named to it was withdrawn: nothing waits at it
