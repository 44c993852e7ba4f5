"""`areal train`: torchrun FSDP workers against discovered (or co-launched) servers."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import typer

from areal_cli import console, settings
from areal_cli.errors import UsageError

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
    "areal_overrides": "bool", "scheduler": "str", "watchdog": "nonneg",
    "watchdog_action": "str",
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
  areal train -a fsdp:d4 --areal-overrides -- -m areal.examples.gsm8k_grpo
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
            help="Append AReaL key=value overrides (allocation_mode, experiment/trial, name_resolve) to the script args.",
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
        watchdog: float = typer.Option(
            None,
            "--watchdog",
            min=0,
            help="Seconds without progress of any rank before the hang doctor runs on the job "
            "(default 300; 0 off).",
        ),
        watchdog_action: str = typer.Option(
            None,
            "--watchdog-action",
            help="On a stall: observe (verdict and bundle in the logs) | fail (then stop, "
            "exit 1) (default observe).",
        ),
        registry: str = RegistryOpt,
        home: Path = HomeOpt,
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
        from areal_cli import discovery, models
        from areal_cli.alloc import parse
        from areal_cli.registry import open_registry
        from areal_cli.spec import JobSpec, ServerRole, TrainerRole

        cfg = load_config(config, CONFIG_KEYS)
        where = scheduler_opts(
            scheduler, cfg, partition, account, time, gpus_per_node, slurm_arg, scheduler_opt
        )
        alloc = pick(alloc, cfg, "alloc", None)
        if not alloc:
            raise UsageError(
                "--alloc is required", hint="e.g. areal train --alloc fsdp:d2 train.py"
            )
        a = parse(alloc)
        if a.train is None:
            raise UsageError(
                f"--alloc {alloc} has no train component",
                hint="add one, e.g. fsdp:d2 (training only) or " + alloc + "+fsdp:d2",
            )
        script_args = list(ctx.args)
        if script == "-m":
            if not script_args:
                raise UsageError(
                    "-m needs a module name",
                    hint="areal train --alloc fsdp:d2 -- -m pkg.train ARGS",
                )
            # torchrun's own -m: "-m pkg.mod ARGS" stands where the script would.
        elif not Path(script).is_file():
            raise UsageError(
                f"script {script} does not exist", hint="give the path of a training script"
            )
        nnodes = int(pick(nnodes, cfg, "nnodes", 1))
        world = a.train.world_size
        if world % nnodes:
            raise UsageError(f"{alloc}: world size {world} does not split over {nnodes} nodes")
        experiment, trial = job_names(experiment, trial, cfg)
        home_dir, reg_root = settings.home(home), settings.registry_url(registry)
        py = pick(python, cfg, "python", None) or python_default()
        env: dict[str, str] = {}
        preset = pick(debug_preset, cfg, "debug_preset", None)
        if preset:
            from areal_cli.diagnose.presets import prepare_paths, preset_env

            env.update(preset_env(preset))
            if not dry_run:
                prepare_paths(env)  # NCCL and the flight recorder write there, never mkdir
        trainer = TrainerRole(
            script=script,
            script_args=tuple(script_args),
            nproc=world // nnodes,
            alloc=alloc,
            nnodes=nnodes,
            node_rank=int(pick(node_rank, cfg, "node_rank", 0)),
            master_addr=str(pick(master_addr, cfg, "master_addr", "127.0.0.1")),
            master_port=pick(master_port, cfg, "master_port", None),
            python=py,
            env=tuple(env.items()),
            areal_overrides=bool(pick(areal_overrides, cfg, "areal_overrides", False)),
        )
        server_role, found = None, None
        if a.inference:
            if len(a.inference) != 1:
                raise UsageError(
                    "train co-launches one inference component", hint="e.g. hf:d1+fsdp:d2"
                )
            comp = a.inference[0]
            model = pick(model, cfg, "model", None)
            if not model:
                raise UsageError(
                    f"--alloc {alloc} starts {comp.backend} servers: --model is required"
                )
            ref = models.parse(str(model))
            server_role = ServerRole(
                backend=comp.backend, model_path=ref.name, revision=ref.revision,
                replicas=comp.d, tp=comp.t, pp=comp.p, python=py,
            )  # fmt: skip
        else:
            servers = str(pick(servers, cfg, "servers", "auto"))
            if servers == "none":
                found = discovery.Found([], "", None, [])
            elif servers != "auto":
                found = discovery.explicit(
                    discovery.parse_addrs(servers),
                    None,
                    _explicit_key(pick(api_key, cfg, "api_key", None)),
                )
            else:
                wait = (
                    0.0
                    if dry_run
                    else seconds("--wait-servers", pick(wait_servers, cfg, "wait_servers", 60.0))
                )
                need = int(pick(min_servers, cfg, "min_servers", 1))
                reg = open_registry(reg_root)
                with console.err.status(
                    f"waiting for servers of {experiment}/{trial} ..."
                ) as status:

                    def progress(n: int, left: float) -> None:
                        status.update(
                            f"waiting for servers of {experiment}/{trial}: {n}/{need} healthy, {left:.0f}s left"
                        )

                    try:
                        found = discovery.from_registry(
                            reg, home_dir, experiment, trial, need, wait, progress
                        )
                    except Exception:
                        if not dry_run:
                            raise
                        found = discovery.Found([], "sglang", None, [])
            if servers != "none":
                console.err.print(
                    f"[green]servers[/] {len(found.addrs)} {found.backend}: "
                    f"{', '.join(found.addrs) or '(none yet)'}"
                )
                for addr, why in found.skipped:
                    console.err.print(f"[yellow]left out[/] {addr}: {why}")
                for addr in found.resumed:
                    console.err.print(
                        f"[yellow]resumed[/] {addr}: it was paused with no trainer of "
                        f"{experiment}/{trial} alive (a weight sync that never finished)"
                    )
        key_flag = pick(api_key, cfg, "api_key", None)
        if server_role is not None and trainer.areal_overrides and key_flag != "none":
            raise UsageError(
                "--areal-overrides: AReaL's trainer sends no API key, and the servers this "
                "job starts would want one (--api-key auto)",
                hint="add --api-key none (any user of this host can then reach the servers), "
                "or train with areal_cli.worker, which sends the key",
            )
        if found is not None and found.addrs and not dry_run:
            found = _check_keys(found, experiment, trial, trainer.areal_overrides,
                                _explicit_key(key_flag))  # fmt: skip
        from areal_cli.diagnose.watchdog import ACTIONS, DEFAULT_SECONDS

        action = str(pick(watchdog_action, cfg, "watchdog_action", "observe"))
        if action not in ACTIONS:
            raise UsageError(
                f"--watchdog-action {action!r} is not one of {', '.join(ACTIONS)}",
                hint="observe keeps the job running; fail stops it on a stall (exit 1)",
            )
        spec = JobSpec(
            watchdog=seconds("--watchdog", pick(watchdog, cfg, "watchdog", DEFAULT_SECONDS)),
            watchdog_action=action,
            experiment=experiment,
            trial=trial,
            servers=server_role,
            trainer=trainer,
            alloc=alloc,
            gpus_flag=pick(gpus, cfg, "gpus", None),
            api_key=str(pick(api_key, cfg, "api_key", "auto")),
            health_timeout=seconds(
                "--health-timeout", pick(health_timeout, cfg, "health_timeout", 600.0)
            ),
            external_servers=tuple(found.addrs) if found else (),
            external_backend=found.backend if found else None,
            external_api_key=found.api_key if found else None,
        )
        spec = replace(spec, scheduler_opts=where)
        sched = scheduler_for(scheduler, cfg, home, registry)
        request = sched.dryrun(spec, check_packages=not dry_run)
        if dry_run:
            show_plan(request, json_out)
            return
        run_foreground(sched, request)


def _check_keys(found, experiment: str, trial: str, areal: bool, given: str | None):
    """Ask every server a question its API key guards, with the key the ranks will send, so
    a missing or wrong key is one message here instead of an HTTP 401 in every rank (/health,
    which discovery asks, is open on every engine). A key given with --api-key or
    AREAL_API_KEY serves found servers that want one discovery did not hand out."""
    from areal_cli import control

    if areal:  # areal/infra/remote_inf_engine.py: no request carries an Authorization header
        refused = control.keys_refused(found.addrs, found.backend, None)
        if refused:
            raise UsageError(
                f"{', '.join(refused)}: want an API key, and AReaL's trainer sends none "
                "(--areal-overrides)",
                hint="serve them with --api-key none (any user of this host can then reach "
                "them), or train with areal_cli.worker, which sends the key",
            )
        return found
    refused = control.keys_refused(found.addrs, found.backend, found.api_key)
    if not refused:
        return found
    if found.api_key is None and given:
        refused = control.keys_refused(list(refused), found.backend, given)
        if not refused:
            return replace(found, api_key=given)
        what = "refuse the key given (--api-key / AREAL_API_KEY)"
    elif found.api_key is None:
        what = "want an API key, and none was given"
    elif not found.entries:  # --servers: the key came from the flag or the environment
        what = "refuse the key given (--api-key / AREAL_API_KEY)"
    else:
        what = "refuse the key of the job that registered them"
    names = ", ".join(f"{a} (HTTP {s})" for a, s in refused.items())
    raise UsageError(
        f"{names}: {what}",
        hint="give the servers' key in the environment, never on a command line: "
        "AREAL_API_KEY=$(areal key E/T) areal train ..., E/T being the job that serves them "
        "(areal ps); for servers started elsewhere, export AREAL_API_KEY",
    )


def _explicit_key(flag: str | None) -> str | None:
    """The key for servers given with --servers: the flag's KEY, else AREAL_API_KEY."""
    if flag and flag not in ("auto", "none"):
        return flag
    return None if flag == "none" else (os.environ.get("AREAL_API_KEY") or None)
