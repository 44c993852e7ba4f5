"""A Slurm step's processes learn their job and node in areal's names (schedulers/slurm/step.py),
and nothing outside a scheduler's package reads that scheduler's own variables."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from areal_cli.schedulers.slurm import step

SRC = Path(__file__).resolve().parents[2] / "src" / "areal_cli"


def test_a_replica_step_is_named_job_dot_step_and_training_by_its_job():
    env = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "2", "SLURMD_NODENAME": "nX",
           "SLURM_NODEID": "1", "SLURM_STEP_GPUS": "2,3", "SLURM_JOB_GPUS": "0,1,2,3"}  # fmt: skip
    got = step.neutral_env(env, "step")
    assert got["AREAL_SCHEDULER_JOB_ID"] == "7.2"
    assert (got["AREAL_NODE_NAME"], got["AREAL_NODE_INDEX"]) == ("nX", "1")
    assert got["AREAL_STEP_GPUS"] == "2,3"  # the step's own, not the job's
    assert step.neutral_env(env, "job")["AREAL_SCHEDULER_JOB_ID"] == "7"
    # Outside Slurm nothing is made up.
    assert step.neutral_env({}, "step") == {}


def test_the_runner_runs_in_the_same_interpreter_with_the_variables_set(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0",
           "SLURMD_NODENAME": "n2", "SLURM_NODEID": "1", "PYTHONPATH": str(SRC.parent)}  # fmt: skip
    code = "import os; print(os.environ['AREAL_SCHEDULER_JOB_ID'], os.environ['AREAL_NODE_NAME'])"
    (tmp_path / "probe.py").write_text(code)
    res = subprocess.run(
        [sys.executable, "-m", "areal_cli.schedulers.slurm.step", "job", "probe"],
        capture_output=True, text=True, env={**env, "PYTHONPATH": f"{tmp_path}:{SRC.parent}"},
        timeout=60, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["9", "n2"]


def test_no_module_outside_the_slurm_package_reads_slurm_variables():
    reads = re.compile(r"""(?:environ|env)(?:\.get\(|\[)\s*["'](SLURM\w*)""")
    offenders = [
        f"{p.relative_to(SRC)}: {m.group(1)}"
        for p in SRC.rglob("*.py")
        if "schedulers/slurm" not in p.as_posix()
        for m in reads.finditer(p.read_text())
    ]
    assert offenders == []
