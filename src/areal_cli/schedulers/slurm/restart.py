"""Between two attempts of a Slurm job's trainers (`areal train --max-restarts N`), inside the
allocation: the batch script runs

    python -m areal_cli.schedulers.slurm.restart RUN CODE

after the torchrun step ended with CODE. The doctor's root cause of that attempt decides
(diagnose.restart): the line goes to stdout (the batch output, supervisor-train.log), the
decision to RUN/restarts.jsonl (`areal ps`, and the `areal` following the job), the attempt's
logs to attempt-<n>/. Exit 0: start the step again; 1: the job ends with the failure."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from areal_cli.diagnose import restart
from areal_cli.schedulers.common import describe_exit
from areal_cli.schedulers.slurm.planner import SlurmPlan
from areal_cli.schedulers.slurm.script import PLAN_FILE


def main(argv: list[str] | None = None) -> int:
    run, code = argv if argv is not None else sys.argv[1:]
    run = Path(run)
    plan = SlurmPlan.from_json(json.loads((run / PLAN_FILE).read_text()))
    log = restart.read_log(run)
    done = sum(1 for d in log if d.get("restart"))
    failure = restart.diagnose(plan.log_dir, exit_what=describe_exit(int(code)))
    decision = restart.decide(
        failure, done, plan.max_restarts, plan.restart_on, restart.previous_failure(log)
    )
    try:
        restart.append_log(run, decision)
    except OSError:
        pass  # a full disk: the line below is still said
    print(f"{time.strftime('%H:%M:%S')} {decision.line}", flush=True)
    if not decision.restart:
        return 1
    restart.archive_logs(plan.log_dir, decision.attempt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
