"""A SIGKILLed rank to the first step after the restart, minus the ranks' own start time
(`areal train --max-restarts 1`, fsdp:d2 on gloo, local scheduler; target <= 3 s).

What the difference is: torchrun and areal noticing the failure, the doctor's root cause of
it, the logs moved aside, and the trainers started again. The ranks' own start time is that
of the restarted trainers themselves: from their launcher's creation (the job record) to their
first step (torchrun's interpreter and torch, the ranks', the rendezvous). Medians of 3."""

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import AREAL, loadavg, report

# Each rank: its creation and the time of its first step, per attempt. Rank 1
# of the first attempt stops at step 3 for the SIGKILL; the restart resumes and ends.
SCRIPT = """
import os, sys, time
from pathlib import Path
import psutil
born = psutil.Process().create_time()
import torch
import torch.distributed as dist
d, rank = Path(sys.argv[1]), int(os.environ["RANK"])
restart = os.environ.get("AREAL_RESTART", "0")
dist.init_process_group("gloo")
step_file = d / f"step-{rank}"
start = int(step_file.read_text()) + 1 if step_file.exists() else 1
(d / f"pid-{rank}").write_text(str(os.getpid()))
for step in range(start, start + 3):
    if restart == "0" and rank == 1 and step == 3:
        (d / "ready").touch()
        time.sleep(600)
    t = torch.ones(1)
    dist.all_reduce(t)
    if step == start:
        (d / f"first-{rank}-{restart}").write_text(f"{born} {time.time()}")
    step_file.write_text(str(step))
dist.destroy_process_group()
"""


def one(tmp: Path, k: int) -> tuple[float, float]:
    """(SIGKILL to the first step after the restart, the restarted trainers' own start)."""
    d = tmp / f"run{k}"
    d.mkdir()
    env = {**os.environ, "AREAL_HOME": f"{tmp}/home", "AREAL_REGISTRY": f"{tmp}/reg",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    proc = subprocess.Popen(
        [AREAL, "train", "--alloc", "fsdp:d2", "--servers", "none", "-t", f"r{k}",
         "--max-restarts", "1", "--watchdog", "0", str(tmp / "steps.py"), str(d)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not (d / "ready").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"the first attempt did not reach step 3:\n{proc.communicate()[1]}")
            time.sleep(0.02)
        killed = time.time()
        os.kill(int((d / "pid-1").read_text()), signal.SIGKILL)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=60)
    if proc.returncode != 0:
        sys.exit(f"the restarted job did not end well ({proc.returncode}):\n{err[-2000:]}")
    firsts = [tuple(map(float, (d / f"first-{r}-1").read_text().split())) for r in (0, 1)]
    first = max(f for _born, f in firsts)
    # The restarted trainers' launcher, as the job record has it: their own start runs from
    # its creation (torchrun's interpreter and torch, the ranks', the rendezvous) to the step.
    user = os.environ.get("USER", "root")
    rec = json.loads(
        (tmp / "home" / "jobs" / user / "default" / f"r{k}" / "train.json").read_text()
    )
    (launcher,) = [p for p in rec["processes"] if p["role"] == "trainer"]
    return first - killed, first - launcher["create_time"]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "steps.py").write_text(SCRIPT)
        runs = [one(tmp, k) for k in range(3)]
    resumed = statistics.median(r for r, _ in runs)
    own = statistics.median(o for _, o in runs)
    extra = statistics.median(r - o for r, o in runs)
    print(f"  SIGKILL to the first step after the restart {resumed:.2f} s, the ranks' own "
          f"start {own:.2f} s (medians of 3; load {loadavg()})")  # fmt: skip
    return 0 if report("restart_after_sigkill_minus_rank_start_s", extra, "<= 3 s",
                       extra <= 3.0) else 1  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
