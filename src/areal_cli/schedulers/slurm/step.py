"""What a process of a Slurm step learns of its job and node, in areal's own names.

The batch script starts every step as

    python -m areal_cli.schedulers.slurm.step (job|step) MODULE ARGS...

which sets the variables every scheduler gives its processes — AREAL_SCHEDULER_JOB_ID,
AREAL_NODE_NAME, AREAL_NODE_INDEX, AREAL_NODE_ADDR, AREAL_STEP_GPUS — from Slurm's own and
then runs MODULE in this same interpreter. So the launchers, the worker runtime and the
doctor read no SLURM_* variable: a scheduler's names stay in its package. `step` names the
job as JOB.STEP (a server replica: its step is what stops it alone), `job` as JOB (training:
the doctor reaches its nodes with srun --jobid).
"""

from __future__ import annotations

import os
import re
import runpy
import shutil
import subprocess
import sys


def neutral_env(env: dict[str, str], which: str) -> dict[str, str]:
    """AREAL_* variables for a process of this step, from Slurm's (only those Slurm set)."""
    out: dict[str, str] = {}
    job, step = env.get("SLURM_JOB_ID"), env.get("SLURM_STEP_ID")
    if job:
        out["AREAL_SCHEDULER_JOB_ID"] = f"{job}.{step}" if which == "step" and step else job
    if env.get("SLURMD_NODENAME"):
        out["AREAL_NODE_NAME"] = env["SLURMD_NODENAME"]
    if env.get("SLURM_NODEID"):
        out["AREAL_NODE_INDEX"] = env["SLURM_NODEID"]
    gpus = env.get("SLURM_STEP_GPUS") or env.get("SLURM_JOB_GPUS")
    if gpus:
        out["AREAL_STEP_GPUS"] = gpus
    addr = node_addr(env.get("SLURMD_NODENAME"))
    if addr:
        out["AREAL_NODE_ADDR"] = addr
    return out


def node_addr(node: str | None) -> str | None:
    """The node's NodeAddr in slurm.conf (several slurmd may share a host, each at an address
    of its own), as an IPv4 address where it resolves; None when Slurm does not say."""
    if not node or not shutil.which("scontrol"):
        return None
    try:
        res = subprocess.run(
            ["scontrol", "show", "node", node, "-o"],
            capture_output=True, text=True, timeout=10, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"\bNodeAddr=(\S+)", res.stdout)
    if not m:
        return None
    import socket

    try:
        return socket.getaddrinfo(m.group(1), None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError):
        return m.group(1)


def main() -> None:
    which, module, *args = sys.argv[1:]
    # Explicit AREAL_* (a user's, or a test's) win over what is derived from Slurm.
    for k, v in neutral_env(dict(os.environ), which).items():
        os.environ.setdefault(k, v)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
