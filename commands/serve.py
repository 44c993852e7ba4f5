"""`areal serve`: start inference servers, health-gate them, register them."""

from __future__ import annotations

import typer

from areal_cli import jobspec

from ._common import (
    asked,
    job_command,
    launch,
    scheduler_for,
)

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
    app.command(
        "serve",
        help=HELP,
        context_settings={"allow_extra_args": True},
        no_args_is_help=True,
    )(job_command(serve))


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
    host: str = typer.Option("127.0.0.1", "--host", help="Bind address"),
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
    detach: bool = typer.Option(
        False, "--detach", "-d", help="Return once every replica is healthy."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and start nothing."),
    health_timeout: float = typer.Option(
        600.0, "--health-timeout", min=0.1, help="Seconds to wait for health"
    ),
    python: str = typer.Option(
        None, "--python", help="Interpreter that runs the servers (their own virtualenv)."
    ),
    api_key: str = typer.Option(
        "auto",
        "--api-key",
        help="auto (a generated key, loopback too) | none | KEY",
    ),
    seed: int = typer.Option(1, "--seed", help="Random seed given to each server"),
    allow_unauthenticated_control: bool = typer.Option(
        False,
        "--allow-unauthenticated-control",
        help="Bind vLLM beyond loopback although nothing guards the control routes a "
        "trainer uses (pause, weight updates; vLLM's --api-key covers only /v1).",
        show_default=False,
    ),
    max_restarts: int = typer.Option(
        3,
        "--max-restarts",
        min=0,
        help="Restarts of a replica whose server exited, per rolling hour, on its GPUs "
        "and address; trainers realign it before they sample from it (0: off)",
    ),
    **_job,
) -> None:
    """Every option is in `ctx` (flag > job YAML > default); jobspec builds the job."""
    options = asked(ctx)
    sched = scheduler_for(options)
    spec, notes, rewritten = jobspec.serve_spec(options, list(ctx.args), sched)
    launch(sched, spec, options, notes=notes, told=rewritten)
