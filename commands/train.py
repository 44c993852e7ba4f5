"""`areal train`: torchrun FSDP workers against discovered (or co-launched) servers."""

from __future__ import annotations

from functools import partial

import typer

from areal_cli import console, jobspec, settings
from areal_cli.diagnose.watchdog import AUTO

from ._common import (
    asked,
    job_command,
    launch,
    scheduler_for,
)

HELP = """Run training workers with torchrun against inference servers.

With a training-only allocation (fsdp:d2), the servers come from the registry under
the same --experiment/--trial (started by `areal serve` or AReaL); train waits up to
--wait-servers for them. With a combined allocation (hf:d1+fsdp:d2), the servers start
first and everything is torn down together. Everything after SCRIPT goes to the script.

Workers find AREAL_LLM_SERVER_ADDRS, AREAL_SERVER_BACKEND, AREAL_API_KEY, AREAL_ALLOC,
AREAL_LOG_DIR, AREAL_EXPERIMENT, AREAL_TRIAL and AREAL_REGISTRY in their environment
(see areal_cli.worker).

\b
Examples:
  areal train --alloc fsdp:d2 templates/grpo/train.py --config my_grpo.yaml
  areal train --alloc hf:d1+fsdp:d2 --model ./tiny templates/grpo/train.py
  areal train -a fsdp:d8 --servers 10.0.0.5:30000 --debug-preset nccl train.py
  areal train -a fsdp:d2 --areal-overrides --python $PY rl.py --config c.yaml
  areal train -a fsdp:d2 --servers none --detach templates/examples/hang.py
"""


def register(app: typer.Typer) -> None:
    app.command(
        "train",
        help=HELP,
        no_args_is_help=True,
        # SCRIPT ends our options: what follows is the script's, even --config.
        context_settings={"allow_interspersed_args": False, "allow_extra_args": True},
    )(job_command(train))


# The options whose help takes several lines, so that train's signature reads as a list.
_AREAL_OVERRIDES = typer.Option(
    False,
    "--areal-overrides/--no-areal-overrides",
    help="Run AReaL's own trainer: append the overrides its version in --python "
    "understands (rollout/actor backend, experiment/trial, name_resolve) to the "
    "script args, and set AREAL_SPMD_MODE=1.",
)
_API_KEY = typer.Option(
    "auto",
    "--api-key",
    help="Co-launched servers: auto | none | KEY (default auto). Servers found: the "
    "KEY they need when it is not their job's (default env AREAL_API_KEY); checked "
    "before any rank starts.",
)
_WATCHDOG = typer.Option(
    AUTO,
    "--watchdog",
    metavar="auto|SECONDS",
    help="No progress of any rank for this long runs the hang doctor on the job: auto "
    "(default) 10x the median step, 20-300 s (300 before 5 steps); SECONDS fixed; 0 off.",
)
_WATCHDOG_ACTION = typer.Option(
    "observe",
    "--watchdog-action",
    help="On a stall: observe (verdict and bundle in the logs) | fail (then stop, exit 1)",
)
_MAX_RESTARTS = typer.Option(
    0,
    "--max-restarts",
    min=0,
    help="Start the trainers again after a failure, at most N times, in the same job "
    "(servers kept); the doctor's root cause decides each time",
)
_RESTART_ON = typer.Option(
    "infra",
    "--restart-on",
    help="infra: restart on faults of the infrastructure (a signal, the OOM killer, a "
    "collective timeout, a lost connection, node or server), stop on a bug that would "
    "repeat | any: restart on every failure",
)
_DETACH = typer.Option(
    False,
    "--detach",
    "-d",
    help="Return once the job runs; `areal logs E/T -f` follows it, `areal stop E/T` ends it.",
)


def train(
    ctx: typer.Context,
    script: str = typer.Argument(
        ..., help="Training script and its arguments; `-- -m pkg.mod ARGS` runs a module."
    ),
    alloc: str = typer.Option(
        None, "--alloc", "-a", help="e.g. fsdp:d2, fsdp:d2t2, hf:d1+fsdp:d2."
    ),
    servers: str = typer.Option(
        "auto", "--servers", help="auto (registry) | host:port,... | none (no servers)"
    ),
    min_servers: int = typer.Option(
        1, "--min-servers", min=1, help="Servers to wait for; all found are used"
    ),
    wait_servers: float = typer.Option(
        60.0, "--wait-servers", min=0, help="Seconds to wait for servers"
    ),
    nnodes: int = typer.Option(1, "--nnodes", min=1, help="Nodes (torchrun)"),
    node_rank: int = typer.Option(0, "--node-rank", min=0, help="This node's rank (torchrun)"),
    master_addr: str = typer.Option(
        "127.0.0.1", "--master-addr", help="Rendezvous host (torchrun)"
    ),
    master_port: int = typer.Option(
        None, "--master-port", min=1, max=65535, help="Rendezvous port (torchrun)."
    ),
    gpus: str = typer.Option(None, "--gpus", help="GPU ids for the workers (default: free ones)."),
    debug_preset: str = typer.Option(
        None, "--debug-preset", help="Env preset from `areal doctor env --list`."
    ),
    model: str = typer.Option(None, "--model", help="Model for co-launched servers."),
    python: str = typer.Option(None, "--python", help="Interpreter for workers and servers."),
    areal_overrides: bool = _AREAL_OVERRIDES,
    health_timeout: float = typer.Option(
        600.0, "--health-timeout", min=0.1, help="For co-launched servers"
    ),
    api_key: str = _API_KEY,
    watchdog: str = _WATCHDOG,
    watchdog_action: str = _WATCHDOG_ACTION,
    max_restarts: int = _MAX_RESTARTS,
    restart_on: str = _RESTART_ON,
    detach: bool = _DETACH,
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print the torchrun command, env and GPUs; start nothing."
    ),
    **_job,
) -> None:
    """Every option is in `ctx` (flag > job YAML > default); jobspec builds the job."""
    options = asked(ctx)
    sched = scheduler_for(options)
    find = partial(_servers, sched, settings.home(options["home"]), dry_run)
    spec = jobspec.train_spec(options, script, list(ctx.args), sched, find)
    launch(sched, spec, options)


def _servers(sched, home, dry_run, servers: str, key, experiment, trial, need, wait):
    """The servers a training-only job uses: none, those given, or the registry's (waiting
    with a status line), each shown on stderr."""
    found = jobspec.servers_given(servers, key)
    if found is None:
        wait = 0.0 if dry_run else jobspec.seconds("--wait-servers", wait)
        with console.err.status(f"waiting for servers of {experiment}/{trial} ...") as status:

            def progress(n: int, left: float) -> None:
                status.update(
                    f"waiting for servers of {experiment}/{trial}: {n}/{need} healthy, {left:.0f}s left"
                )

            found = jobspec.servers_from_registry(
                sched.opened_registry(), home, experiment, trial, need, wait, progress, dry_run
            )
    if servers != "none":
        engine = found.backend
        if not found.backend_known:
            engine = f"(engine unknown; {found.backend} protocol assumed)"
        console.err.print(
            f"[green]servers[/] {len(found.addrs)} {engine}: "
            f"{', '.join(found.addrs) or '(none yet)'}"
        )
        for addr, why in found.skipped:
            console.err.print(f"[yellow]left out[/] {addr}: {why}")
        for addr in found.resumed:
            console.err.print(
                f"[yellow]resumed[/] {addr}: it was paused with no trainer of "
                f"{experiment}/{trial} alive (a weight sync that never finished)"
            )
    return found
