"""`areal serve`: start inference servers, health-gate them, register them."""

from __future__ import annotations

from pathlib import Path

import typer

from areal_cli import console
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
    run_detached,
    run_foreground,
    scheduler_for,
    scheduler_opts,
    seconds,
    show_plan,
)

CONFIG_KEYS = {
    "backend": "str", "model": "str", "alloc": "str", "dp": "posint", "tp": "posint",
    "experiment": "str", "trial": "str", "host": "str", "port_base": "port", "gpus": "str",
    "health_timeout": "posfloat", "python": "str", "api_key": "str", "seed": "int",
    "extra_args": "list", "scheduler": "str", "allow_unauthenticated_control": "bool",
    "max_restarts": "int",
}  # fmt: skip
CONFIG_KEYS.update(SLURM_KEYS)

HELP = """Start SGLang, vLLM or hf inference servers, wait until healthy, register them.

Each replica gets its own GPUs (CUDA_VISIBLE_DEVICES slices) and port; logs go to the
terminal with a \\[server-N] prefix and to one file per replica. Registered servers are
what `areal train` discovers under the same --experiment/--trial. Arguments after --
go to the backend server.

\b
Examples:
  areal serve --backend sglang --model Qwen/Qwen2.5-1.5B-Instruct --dp 4
  areal serve --backend hf --model ./tiny --detach  # CPU; back when healthy
  areal serve --model /models/m --dp 2 --tp 2 --dry-run  # print the plan only
  areal serve --backend vllm --model /models/m -- --max-model-len 4096
"""


def register(app: typer.Typer) -> None:
    @app.command(
        "serve",
        help=HELP,
        context_settings={"allow_extra_args": True},
        no_args_is_help=True,
    )
    def serve(
        ctx: typer.Context,
        model: str = typer.Option(
            None, "--model", "-m", help="Model directory or hub id (org/name[@revision])."
        ),
        backend: str = typer.Option(
            None,
            "--backend",
            "-b",
            help="sglang | vllm | hf (default: from --alloc; sglang with GPUs, hf without).",
        ),
        alloc: str = typer.Option(None, "--alloc", "-a", help="Allocation, e.g. sglang:d2t2."),
        dp: int = typer.Option(None, "--dp", min=1, help="Replicas (instead of --alloc)."),
        tp: int = typer.Option(None, "--tp", min=1, help="Tensor parallel GPUs per replica."),
        experiment: str = ExperimentOpt,
        trial: str = TrialOpt,
        host: str = typer.Option(None, "--host", help="Bind address (default 127.0.0.1)."),
        port_base: int = typer.Option(
            None,
            "--port-base",
            min=1,
            max=65535,
            help="First port; must be free (default: find free ports from 30000).",
        ),
        gpus: str = typer.Option(
            None,
            "--gpus",
            help="GPU ids to use, e.g. 0,1,2,3 (default: CUDA_VISIBLE_DEVICES, else nvidia-smi).",
        ),
        registry: str = RegistryOpt,
        home: Path = HomeOpt,
        config: Path = typer.Option(None, "--config", "-c", help="Job YAML; keys are these flags."),
        detach: bool = typer.Option(
            False, "--detach", "-d", help="Return once every replica is healthy."
        ),
        dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and start nothing."),
        health_timeout: float = typer.Option(
            None, "--health-timeout", min=0.1, help="Seconds to wait for health (default 600)."
        ),
        python: str = typer.Option(
            None, "--python", help="Interpreter that runs the servers (their own virtualenv)."
        ),
        api_key: str = typer.Option(
            None,
            "--api-key",
            help="auto (a generated key, loopback too) | none | KEY (default auto).",
        ),
        seed: int = typer.Option(
            None, "--seed", help="Random seed given to each server (default 1)."
        ),
        allow_unauthenticated_control: bool = typer.Option(
            None,
            "--allow-unauthenticated-control",
            help="Bind vLLM beyond loopback although nothing guards the control routes a "
            "trainer uses (pause, weight updates; vLLM's --api-key covers only /v1).",
            show_default=False,
        ),
        max_restarts: int = typer.Option(
            None,
            "--max-restarts",
            min=0,
            help="Restarts of a replica whose server exited, per rolling hour, on its GPUs "
            "and address; trainers realign it before they sample from it (default 3; 0: off).",
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
        from areal_cli import jobspec, models
        from areal_cli.spec import JobSpec, ServerRole

        cfg = load_config(config, CONFIG_KEYS)
        sched = scheduler_for(scheduler, cfg, home, registry)
        where = scheduler_opts(
            sched, cfg, partition, account, time, gpus_per_node, slurm_arg, scheduler_opt
        )
        model = pick(model, cfg, "model", None)
        if not model:
            raise UsageError("--model is required", hint="areal serve --model /path/to/model")
        # A dry run plans without the model: on a cluster it may exist on the nodes only.
        ref = models.parse(str(model), missing_ok=dry_run)
        notes = [] if ref.found else [f"model {ref.name} not found on this host"]
        shape, rewritten = jobspec.serve_shape(
            {"alloc": alloc, "backend": backend, "dp": dp, "tp": tp}, cfg
        )
        notes += rewritten
        allocation, backend, dp, tp, pp = jobspec.serve_allocation(
            shape.get("alloc"), shape.get("backend"), shape.get("dp"), shape.get("tp")
        )
        gpus_flag = pick(gpus, cfg, "gpus", None)
        role = ServerRole(
            backend=backend or jobspec.default_backend(gpus_flag),
            model_path=ref.name,
            revision=ref.revision,
            replicas=dp or 1,
            tp=tp or 1,
            pp=pp,
            host=pick(host, cfg, "host", "127.0.0.1"),
            port_base=pick(port_base, cfg, "port_base", None),
            python=pick(python, cfg, "python", None) or python_default(),
            extra_args=tuple(list(ctx.args) or cfg.get("extra_args", [])),
            seed=int(pick(seed, cfg, "seed", 1)),
            allow_unauthenticated_control=bool(
                pick(allow_unauthenticated_control, cfg, "allow_unauthenticated_control", False)
            ),
            max_restarts=jobspec.restart_budget(pick(max_restarts, cfg, "max_restarts", 3)),
        )
        experiment, trial = job_names(experiment, trial, cfg)
        spec = JobSpec(
            experiment=experiment,
            trial=trial,
            servers=role,
            alloc=allocation.text if allocation else jobspec.serve_alloc_text(role),
            allocation=allocation,
            gpus_flag=None if gpus_flag is None else str(gpus_flag),
            api_key=str(pick(api_key, cfg, "api_key", "auto")),
            health_timeout=seconds(
                "--health-timeout", pick(health_timeout, cfg, "health_timeout", 600.0)
            ),
            scheduler_opts=where,
        )
        request = sched.dryrun(spec, check_packages=not dry_run)
        request.plan.notes[:0] = notes
        if dry_run:
            show_plan(request, json_out)
            return
        for note in rewritten:
            console.err.print(f"[yellow]note[/] {note}")
        if detach:
            run_detached(sched, request, json_out)
        else:
            run_foreground(sched, request, json_out)
