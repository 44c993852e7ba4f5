"""`areal train --scheduler slurm --max-restarts N` on the real two-node cluster of
tests/services.py: the batch script starts the torchrun step again inside the same allocation
when the doctor's root cause says a restart may pass, and stops at once on a bug that would
repeat. Nothing is left afterwards (the leak check, and no queued job)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration import restart_checks as rc

SLURM = ("--scheduler", "slurm", "--alloc", "fsdp:d2", "--gpus-per-node", "1", "--servers",
         "none", "--watchdog", "0")  # fmt: skip


def test_sigkilled_rank_restarts_in_the_same_allocation(slurm_env, tmp_path):
    scen = tmp_path / "scen"
    scen.mkdir()
    line, job = rc.killed_step_script([*SLURM, "-e", "rs", "-t", "kill"], scen,
                                      ready_s=180, end_s=240)  # fmt: skip
    # One allocation: the restart is a new step of the same Slurm job, said in its output.
    assert line in (Path(job["log_dir"]) / "supervisor-train.log").read_text()
    for rank in (0, 1):
        (job1, step1), (job2, step2) = [
            x.split() for x in (scen / f"slurm-{rank}").read_text().splitlines()
        ]
        assert job1 == job2 == job["job_id"] and step1 != step2


@pytest.mark.slurm
@pytest.mark.slow
def test_grpo_killed_rank_resumes_from_its_checkpoint(slurm_env, tmp_path):
    """Issue #26 on Slurm: hf servers in a Slurm job of their own, the GRPO example on both
    nodes; rank 1 SIGKILLed once a checkpoint exists comes back as a new step of the same
    allocation and goes on from that checkpoint, with the servers brought back to it."""
    from areal_cli.modelgen import create_tiny_model

    tiny = create_tiny_model(tmp_path / "tiny", seed=0)
    with rc.serving("slurm", tiny, "rs/grpo", timeout=240) as served:
        _, job = rc.killed_grpo(["--scheduler", "slurm", "--alloc", "fsdp:d2", "--gpus-per-node",
                                 "1"], "rs/grpo", 10, ready_s=360, end_s=480)  # fmt: skip
    assert sorted(job["nodes"]) == ["n1", "n2"], job  # the ranks ran on both nodes
    queued = slurm_env.run("squeue", "-h", "-o", "%i").stdout.split()
    assert served["job_id"] not in queued and job["job_id"] not in queued, queued


def test_deterministic_bug_is_not_retried(slurm_env, tmp_path):
    rc.bug_not_retried([*SLURM, "-e", "rs", "-t", "bug"], tmp_path, timeout=240)
