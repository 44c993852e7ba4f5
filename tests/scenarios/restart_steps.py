"""A training loop that resumes: every rank keeps its last finished step in DIR and starts
again after it, so a restarted job is seen to resume, not to start over.

    restart_steps.py DIR [MODE@STEP] [STEPS]
    (arguments, not the environment: Ray starts ranks in its nodes' environment)

    STEPS              steps in all (default 6)
    MODE@STEP          at that step of every attempt: value (a ValueError in this file),
                       cuda (rank 0 raises a CUDA error, a fault a restart may cure), or
                       wait (rank 1 of the first attempt stops there and touches ready-1,
                       for the test to SIGKILL it)

Files in DIR: step-<rank> (the last finished step), runs-<rank> (one line per
attempt: "AREAL_RESTART first-step"), slurm-<rank> (under Slurm, one line per attempt: "job
step"), ready-1, pid-<rank>.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import _scenario as sc
import torch
import torch.distributed as dist

sc.self_destruct()
args = sys.argv[1:]
d = Path(args[0])
step_file = d / f"step-{sc.RANK}"
start = int(step_file.read_text()) + 1 if step_file.exists() else 1
restart = os.environ.get("AREAL_RESTART", "")
with open(d / f"runs-{sc.RANK}", "a") as f:
    f.write(f"{restart or '-'} {start}\n")
if os.environ.get("SLURM_JOB_ID"):  # under Slurm: which job and step this attempt ran in
    with open(d / f"slurm-{sc.RANK}", "a") as f:
        f.write(f"{os.environ['SLURM_JOB_ID']} {os.environ.get('SLURM_STEP_ID')}\n")
(d / f"pid-{sc.RANK}").write_text(str(os.getpid()))
mode, _, at = (args[1] if len(args) > 1 else "").partition("@")
fail_at = int(at) if at else 0
sc.init_gloo()
for step in range(start, (int(args[2]) if len(args) > 2 else 6) + 1):
    if step == fail_at:
        if mode == "value":
            raise ValueError(f"bad batch shape at step {step}")
        if mode == "cuda" and sc.RANK == 0:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if mode == "wait" and sc.RANK == 1 and not restart:
            (d / "ready-1").touch()
            time.sleep(600)
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"step {step} sum {int(t.item())}", flush=True)
    tmp = d / f".step-{sc.RANK}"
    tmp.write_text(str(step))
    tmp.replace(step_file)
dist.destroy_process_group()
