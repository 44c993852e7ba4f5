"""The watchdog of a Slurm training job (`--watchdog SECONDS`), run by the batch script on the
job's first node beside its torchrun step, so a detached job is watched as a foreground one:

    "$PY" -m areal_cli.schedulers.slurm.watch "$RUN" "$trainer" &

Every look is a short `srun --overlap` on each training node (diagnose.watchdog.watch_nodes,
through SlurmScheduler.run_on_nodes): the ranks' doctor channels are Unix sockets, readable on
their own node only. On a stall the hang doctor samples every node the same way; the verdict
goes to watchdog.log (`areal logs`), the batch script's output, the bundle in the log folder
and `$RUN/watchdog.json`, which `areal ps` and `areal train` read. With `--watchdog-action
fail` it then ends the torchrun step and leaves `$RUN/watchdog.fail`: the script exits 1.

It exits when the torchrun step's shell (`$trainer`) is gone.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from areal_cli import request_errors
from areal_cli.diagnose import watchdog
from areal_cli.errors import ArealError
from areal_cli.files import write_atomic
from areal_cli.schedulers.cluster_live import servers_by_node
from areal_cli.schedulers.lifecycle import FAIL_FILE, STALL_FILE
from areal_cli.schedulers.slurm import SlurmScheduler, cluster
from areal_cli.schedulers.slurm.planner import SlurmPlan
from areal_cli.schedulers.slurm.script import PLAN_FILE


def _stop_step(trainer: int) -> None:
    """End the torchrun step: SIGTERM to its srun, which hands it to every node's torchrun
    (each tears its ranks down); SIGKILL after a grace period, which makes srun end the step."""
    import psutil

    try:
        sruns = psutil.Process(trainer).children()
    except psutil.Error:
        return
    for p in sruns:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _gone, alive = psutil.wait_procs(sruns, timeout=15)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    run, trainer = Path(args[0]), int(args[1])
    plan = SlurmPlan.from_json(json.loads((run / PLAN_FILE).read_text()))
    job_id = os.environ["SLURM_JOB_ID"]
    group = plan.trainers[0].group
    sched = SlurmScheduler(home=Path(plan.home))
    known: list[str] = []

    def nodes() -> list[str]:
        if not known:
            try:
                info = cluster.jobs([job_id]).get(job_id)
            except Exception:  # the controller is slow: next look
                return []
            if info is not None:
                known.extend(info.components.get(group) or info.nodes)
        return known

    def on_stall(stall: watchdog.Stall) -> None:
        line = watchdog.log_line(plan.log_dir, stall, plan.watchdog)
        state = {**stall.to_json(), "seconds": plan.watchdog, "action": plan.watchdog_action}
        try:
            write_atomic(run / STALL_FILE, json.dumps(state, indent=2))
        except (OSError, ArealError):
            pass  # a full disk: the stall is still acted on (and in the watchdog's line)
        print(f"areal watchdog: {line}", flush=True)  # the batch script's output
        if plan.watchdog_action == "fail":
            try:
                write_atomic(run / FAIL_FILE, stall.headline())
            except (OSError, ArealError):
                pass  # the trainers are stopped all the same
            _stop_step(trainer)

    dog = watchdog.watch_nodes(
        plan.watchdog, plan.log_dir, job_id=job_id, nodes=nodes, marker=plan.marker,
        reach=sched.run_on_nodes, label=f"job {plan.experiment}/{plan.trial} (Slurm job "
        f"{job_id})", on_stall=on_stall, servers=lambda: servers_by_node(plan), python=plan.runner_python or None,
        refused=request_errors.of_trial(plan.registry, plan.experiment, plan.trial),
        auto=plan.watchdog_auto,
    )  # fmt: skip
    try:
        while os.path.exists(f"/proc/{trainer}"):
            time.sleep(1.0)
    finally:
        dog.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
