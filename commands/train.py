"""`areal train`: torchrun FSDP workers against discovered (or co-launched) servers."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import typer

from areal_cli import console, settings

from ._common import (
    SLURM_KEYS,
    AccountOpt,
    ExperimentOpt,
    GpusPerNodeOpt,
    HomeOpt,
    JsonOpt,
    PartitionOpt,
    RegistryOpt,
    SchedulerOpt,
    SchedulerOptOpt,
    SlurmArgOpt,
    TimeOpt,
    TrialOpt,
    job_names,
    load_config,
    pick,
    python_default,
    run_detached,
    run_foreground,
    scheduler_for,
    scheduler_opts,
    seconds,
    show_plan,
)

CONFIG_KEYS = {
    "alloc": "str", "experiment": "str", "trial": "str", "servers": "str",
    "min_servers": "posint", "wait_servers": "nonneg", "nnodes": "posint", "node_rank": "int",
    "master_addr": "str", "master_port": "port", "gpus": "str", "debug_preset": "str",
    "model": "str", "python": "str", "health_timeout": "posfloat", "api_key": "str",
    "areal_overrides": "bool", "scheduler": "str", "watchdog": "str",
    "watchdog_action": "str", "max_restarts": "int", "restart_on": "str",
}  # fmt: skip
CONFIG_KEYS.update(SLURM_KEYS)

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
    @app.command(
        "train",
        help=HELP,
        no_args_is_help=True,
        # SCRIPT ends our options: what follows is the script's, even --config.
        context_settings={"allow_interspersed_args": False, "allow_extra_args": True},
    )
    def train(
        ctx: typer.Context,
        script: str = typer.Argument(
            ..., help="Training script and its arguments; `-- -m pkg.mod ARGS` runs a module."
        ),
        alloc: str = typer.Option(
            None, "--alloc", "-a", help="e.g. fsdp:d2, fsdp:d2t2, hf:d1+fsdp:d2."
        ),
        experiment: str = ExperimentOpt,
        trial: str = TrialOpt,
        servers: str = typer.Option(
            None,
            "--servers",
            help="auto (registry) | host:port,... | none (no servers) (default auto).",
        ),
        min_servers: int = typer.Option(
            None,
            "--min-servers",
            min=1,
            help="Servers to wait for (default 1; all found are used).",
        ),
        wait_servers: float = typer.Option(
            None, "--wait-servers", min=0, help="Seconds to wait for servers (default 60)."
        ),
        nnodes: int = typer.Option(None, "--nnodes", min=1, help="Nodes (torchrun)."),
        node_rank: int = typer.Option(
            None, "--node-rank", min=0, help="This node's rank (torchrun)."
        ),
        master_addr: str = typer.Option(None, "--master-addr", help="Rendezvous host (torchrun)."),
        master_port: int = typer.Option(
            None, "--master-port", min=1, max=65535, help="Rendezvous port (torchrun)."
        ),
        gpus: str = typer.Option(
            None, "--gpus", help="GPU ids for the workers (default: free ones)."
        ),
        config: Path = typer.Option(
            None, "--config", "-c", help="Job YAML (keys are these flags)."
        ),
        debug_preset: str = typer.Option(
            None, "--debug-preset", help="Env preset from `areal doctor env --list`."
        ),
        model: str = typer.Option(None, "--model", help="Model for co-launched servers."),
        python: str = typer.Option(None, "--python", help="Interpreter for workers and servers."),
        areal_overrides: bool = typer.Option(
            None,
            "--areal-overrides/--no-areal-overrides",
            help="Run AReaL's own trainer: append the overrides its version in --python "
            "understands (rollout/actor backend, experiment/trial, name_resolve) to the "
            "script args, and set AREAL_SPMD_MODE=1.",
        ),
        health_timeout: float = typer.Option(
            None, "--health-timeout", min=0.1, help="For co-launched servers (default 600)."
        ),
        api_key: str = typer.Option(
            None,
            "--api-key",
            help="Co-launched servers: auto | none | KEY (default auto). Servers found: the "
            "KEY they need when it is not their job's (default env AREAL_API_KEY); checked "
            "before any rank starts.",
        ),
        watchdog: str = typer.Option(
            None,
            "--watchdog",
            metavar="auto|SECONDS",
            help="No progress of any rank for this long runs the hang doctor on the job: auto "
            "(default) 10x the median step, 20-300 s (300 before 5 steps); SECONDS fixed; 0 off.",
        ),
        watchdog_action: str = typer.Option(
            None,
            "--watchdog-action",
            help="On a stall: observe (verdict and bundle in the logs) | fail (then stop, "
            "exit 1) (default observe).",
        ),
        max_restarts: int = typer.Option(
            None,
            "--max-restarts",
            min=0,
            help="Start the trainers again after a failure, at most N times, in the same job "
            "(servers kept); the doctor's root cause decides each time (default 0).",
        ),
        restart_on: str = typer.Option(
            None,
            "--restart-on",
            help="infra: restart on faults of the infrastructure (a signal, the OOM killer, a "
            "collective timeout, a lost connection, node or server), stop on a bug that would "
            "repeat | any: restart on every failure (default infra).",
        ),
        registry: str = RegistryOpt,
        home: Path = HomeOpt,
        detach: bool = typer.Option(
            False,
            "--detach",
            "-d",
            help="Return once the job runs; `areal logs E/T -f` follows it, `areal stop E/T` "
            "ends it.",
        ),
        dry_run: bool = typer.Option(
            False, "--dry-run", help="Print the torchrun command, env and GPUs; start nothing."
        ),
        scheduler: str = SchedulerOpt,
        partition: str = PartitionOpt,
        account: str = AccountOpt,
        time: str = TimeOpt,
        gpus_per_node: int = GpusPerNodeOpt,
        slurm_arg: list[str] = SlurmArgOpt,
        scheduler_opt: list[str] = SchedulerOptOpt,
        json_out: bool = JsonOpt,
    ) -> None:
        from areal_cli import jobspec
        from areal_cli.diagnose.watchdog import AUTO
        from areal_cli.spec import JobSpec

        cfg = load_config(config, CONFIG_KEYS)
        sched = scheduler_for(scheduler, cfg, home, registry)
        where = scheduler_opts(
            sched, cfg, partition, account, time, gpus_per_node, slurm_arg, scheduler_opt
        )
        allocation = jobspec.train_allocation(pick(alloc, cfg, "alloc", None))
        py = pick(python, cfg, "python", None) or python_default()
        trainer = jobspec.trainer_role(
            script,
            list(ctx.args),
            allocation,
            int(pick(nnodes, cfg, "nnodes", 1)),
            node_rank=int(pick(node_rank, cfg, "node_rank", 0)),
            master_addr=str(pick(master_addr, cfg, "master_addr", "127.0.0.1")),
            master_port=pick(master_port, cfg, "master_port", None),
            python=py,
            areal_overrides=bool(pick(areal_overrides, cfg, "areal_overrides", False)),
        )
        experiment, trial = job_names(experiment, trial, cfg)
        env = jobspec.debug_env(pick(debug_preset, cfg, "debug_preset", None), not dry_run)
        trainer = replace(trainer, env=tuple(env.items()))
        server_role = jobspec.colaunched_servers(allocation, pick(model, cfg, "model", None), py)
        key_flag = pick(api_key, cfg, "api_key", None)
        found = None
        if server_role is None:
            found = _servers(
                sched, str(pick(servers, cfg, "servers", "auto")), key_flag, experiment, trial,
                pick(min_servers, cfg, "min_servers", 1), pick(wait_servers, cfg, "wait_servers", 60.0),
                settings.home(home), dry_run,
            )  # fmt: skip
        jobspec.check_overrides_key(server_role, trainer.areal_overrides, key_flag)
        if found is not None and found.addrs and not dry_run:
            found = jobspec.checked_keys(
                found, trainer.areal_overrides, jobspec.explicit_key(key_flag)
            )
        if trainer.areal_overrides:
            trainer = jobspec.areal_trainer(
                trainer, server_role, found, dry_run, sched.opened_registry(), (experiment, trial)
            )
        limit_s, auto = jobspec.watchdog_limit(pick(watchdog, cfg, "watchdog", AUTO))
        spec = JobSpec(
            watchdog=limit_s,
            watchdog_auto=auto,
            watchdog_action=jobspec.watchdog_action(
                str(pick(watchdog_action, cfg, "watchdog_action", "observe"))
            ),
            max_restarts=_restarts(pick(max_restarts, cfg, "max_restarts", 0)),
            restart_on=jobspec.restart_on(str(pick(restart_on, cfg, "restart_on", "infra"))),
            experiment=experiment,
            trial=trial,
            servers=server_role,
            trainer=trainer,
            alloc=allocation.text,
            allocation=allocation,
            gpus_flag=pick(gpus, cfg, "gpus", None),
            api_key=str(pick(api_key, cfg, "api_key", "auto")),
            health_timeout=seconds(
                "--health-timeout", pick(health_timeout, cfg, "health_timeout", 600.0)
            ),
            external_servers=tuple(found.addrs) if found else (),
            external_backend=found.backend if found else None,
            external_api_key=found.api_key if found else None,
            scheduler_opts=where,
        )
        request = sched.dryrun(spec, check_packages=not dry_run)
        if dry_run:
            show_plan(request, json_out)
            return
        if detach:
            run_detached(sched, request, json_out)
        else:
            run_foreground(sched, request)


def _restarts(value) -> int:
    from areal_cli.errors import UsageError

    if int(value) < 0:
        raise UsageError(f"max_restarts must be >= 0, not {value}")
    return int(value)


def _servers(sched, servers: str, key_flag, experiment, trial, need, wait, home, dry_run):
    """The servers a training-only job uses: none, those given, or the registry's (waiting
    with a status line), each shown on stderr."""
    from areal_cli import jobspec

    found = jobspec.servers_given(servers, key_flag)
    if found is None:
        need = int(need)
        wait = 0.0 if dry_run else seconds("--wait-servers", wait)
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
