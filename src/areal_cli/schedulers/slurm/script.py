"""The batch script of a job: one `#SBATCH` block per component (a heterogeneous job when servers
and trainers are submitted together), then one `srun` step per server replica and one for the
torchrun of every training node. It is what `--dry-run` prints, and nothing secret is in it:
the API key stays in the private plan and environment files the runners read.

Each step leaves its exit code in the run folder (`server-0.exit`, `torchrun.exit`), where
`areal` reads the root cause of a failure.
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from areal_cli.schedulers.slurm.planner import SlurmPlan, SlurmProcess

PLAN_FILE = "plan.json"
TRAINER_ENV_FILE = "trainer.env"
RENDEZVOUS_FILE = "rendezvous"
# Each step's runner learns its job and node in areal's names (schedulers/slurm/step.py).
_IN_STEP = ["$PY", "-m", "areal_cli.schedulers.slurm.step"]


def supervisor_log(plan: SlurmPlan) -> str:
    """The batch script's own output: where `areal logs --role supervisor` finds it."""
    slot = "serve" if plan.kind == "serve" else "train"
    return f"{plan.log_dir}/supervisor-{slot}.log"


def render(plan: SlurmPlan) -> str:
    """The batch script: its #SBATCH header, the shell's setup, a step per server replica,
    then the trainers' step (in a loop of attempts with --max-restarts), or the wait for the
    servers of a serving job."""
    het = len(plan.components) > 1
    lines = _header(plan) + _setup(plan)
    for p in plan.servers:
        lines += _step(
            f"server-{p.index}",
            _srun(p, het, exact=True),
            [*_IN_STEP, "step", "areal_cli.launchers.replica", f"$RUN/{PLAN_FILE}", "--index", str(p.index)],
        )  # fmt: skip
    lines += _trainers(plan, het) if plan.trainers else _serving_end()
    lines += ['echo "$code" > "$RUN/job.exit"', 'exit "$code"', ""]
    return "\n".join(lines)


def _header(plan: SlurmPlan) -> list[str]:
    """What the job is, in a comment, and its #SBATCH options: one block per component."""
    servers, trainers = plan.servers, plan.trainers
    what = []
    if servers:
        what.append(f"{len(servers)} {servers[0].backend} server(s)")
    if trainers:
        what.append(f"torchrun on {trainers[0].nodes} node(s)")
    lines = [
        "#!/bin/bash",
        f"# areal {plan.kind} {plan.experiment}/{plan.trial}: {' + '.join(what)}.",
        "# Written by areal and submitted with sbatch; `areal stop "
        f"{plan.experiment}/{plan.trial}` cancels it.",
        f"#SBATCH --job-name={plan.job_name}",
        f"#SBATCH --output={supervisor_log(plan)}",
        "#SBATCH --no-requeue",
    ]
    for i, comp in enumerate(plan.components):
        if i:
            lines.append("#SBATCH hetjob")
        for opt, value in (
            ("partition", plan.partition),
            ("account", plan.account),
            ("time", plan.time),
        ):
            if value:
                lines.append(f"#SBATCH --{opt}={value}")
        lines.append(f"#SBATCH --nodes={comp.nodes}")
        lines.append(f"#SBATCH --ntasks-per-node={comp.tasks_per_node}")
        if comp.gpus_per_node:
            lines.append(f"#SBATCH --gres=gpu:{comp.gpus_per_node}")
        lines += [f"#SBATCH {arg}" for arg in plan.slurm_args]
    return lines


def _setup(plan: SlurmPlan) -> list[str]:
    """The job's marker and names in the environment, and the `step` function."""
    return [
        "",
        "shopt -s nullglob",
        f"export AREAL_JOB_MARKER={shlex.quote(plan.marker)}",
        "export AREAL_SCHEDULER_NAME=slurm",
        f"RUN={shlex.quote(plan.run_dir)}",
        f"PY={shlex.quote(plan.runner_python)}",
        "",
        "# Each step leaves its exit code in $RUN/<label>.exit, where areal finds the root cause.",
        'step() { local label=$1; shift; "$@"; echo $? > "$RUN/$label.exit"; }',
        "",
    ]


def _trainers(plan: SlurmPlan, het: bool) -> list[str]:
    """The torchrun step and its watchdog, waited on; with --max-restarts, in a loop whose
    every failed attempt the doctor's root cause decides on (slurm/restart.py)."""
    lines: list[str] = []
    restarts = plan.max_restarts > 0
    if restarts:
        lines += [
            f"# --max-restarts {plan.max_restarts}: after a failed attempt the doctor's root "
            "cause decides (areal_cli.schedulers.slurm.restart);",
            "# the trainers start again in this allocation, AREAL_RESTART=<n> in their "
            "environment.",
            "while :; do",
        ]
    for p in plan.trainers:
        runner = [*_IN_STEP, "job", "areal_cli.launchers.torchrun", "--log-dir", plan.log_dir]
        runner += ["--own-log", "torchrun-{node}.log", "--env-file", f"$RUN/{TRAINER_ENV_FILE}"]
        if p.nodes > 1:
            runner += ["--rendezvous-file", f"$RUN/{RENDEZVOUS_FILE}"]
        lines += _step("torchrun", _srun(p, het, exact=False), runner, p.argv)
        lines += ["trainer=$!"]
        if plan.watchdog > 0:
            lines += [
                "",
                f"# The watchdog (--watchdog {_watchdog_flag(plan)}): on this node, beside "
                "training.",
                '"$PY" -m areal_cli.schedulers.slurm.watch "$RUN" "$trainer" &',
                "watcher=$!",
            ]
        lines += [
            "",
            "# The job ends with training; Slurm then stops the servers' steps.",
            'wait "$trainer"',
            'code=$(cat "$RUN/torchrun.exit" 2>/dev/null || echo 1)',
        ]
        if plan.watchdog > 0:
            lines += [
                'kill "$watcher" 2>/dev/null',
                '[ -e "$RUN/watchdog.fail" ] && code=1  # the watchdog ended a stalled job',
            ]
    if restarts:
        lines += [
            '[ "$code" = 0 ] && break',
            '[ -e "$RUN/watchdog.fail" ] && break  # --watchdog-action fail: the job ends',
            '"$PY" -m areal_cli.schedulers.slurm.restart "$RUN" "$code" || break',
            "export AREAL_RESTART=$((${AREAL_RESTART:-0} + 1))",
            f'rm -f "$RUN/torchrun.exit" "$RUN/{RENDEZVOUS_FILE}"',
            "done",
        ]
    return lines


def _serving_end() -> list[str]:
    """A serving job's end: once every replica's has, the first failure is its code."""
    return [
        "",
        "# Serving ends when every replica has: the first failure is the job's code.",
        "wait",
        "code=0",
        'for f in "$RUN"/server-*.exit; do c=$(<"$f"); [ "$c" = 0 ] || { code=$c; break; }; done',
    ]


def _srun(p: SlurmProcess, het: bool, exact: bool) -> list[str]:
    cmd = ["srun"]
    if het:
        cmd.append(f"--het-group={p.group}")
    cmd += [f"--nodes={p.nodes}", f"--ntasks={p.nodes}", "--ntasks-per-node=1"]
    cmd.append(f"--relative={p.node}")
    if p.gpus_per_node:
        cmd.append(f"--gres=gpu:{p.gpus_per_node}")
    if exact:
        # Several replicas share a node: each step gets only its own CPUs and GPUs; the
        # CPUs per task the job asked for (--slurm-arg=--cpus-per-task=N), which srun does
        # not take from sbatch by itself.
        cmd += ["--exact", "${SLURM_CPUS_PER_TASK:+--cpus-per-task=$SLURM_CPUS_PER_TASK}"]
    else:
        # One node's torchrun failing ends the others (root cause first, no silent hang).
        cmd.append("--kill-on-bad-exit=1")
    return cmd


def _quote(a: str) -> str:
    if a.startswith(("$RUN", "$PY")):
        return f'"{a}"'  # expands in the script, one word
    if a.startswith("${"):
        return a  # expands to a flag, or to nothing
    return shlex.quote(a)


def _step(label: str, srun: list[str], command: list[str], after: list[str] = ()) -> list[str]:
    """`step LABEL srun ... command [-- after] &`, one part per line."""

    def q(args) -> str:
        # $RUN and $PY expand in the script; everything else is literal.
        return " ".join(_quote(a) for a in args)

    lines = [f"step {label} {q(srun)} \\", f"    {q(command)}"]
    if after:
        lines[-1] += " -- \\"
        lines.append(f"    {q(after)}")
    lines[-1] += " &"
    return lines


def _watchdog_flag(plan) -> str:
    return "auto" if plan.watchdog_auto else f"{plan.watchdog:g}"
