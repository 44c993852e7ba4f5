"""Inference backends: how to launch one replica and how to tell it is ready.

Each backend turns (role, port, host) into the argv of one server replica. GPUs are handed
over by CUDA_VISIBLE_DEVICES slices, so every replica counts its GPUs from 0.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from areal_cli.errors import UsageError
from areal_cli.spec import ServerRole


@dataclass(frozen=True)
class Backend:
    name: str
    package: str  # importable module that must exist in the server's interpreter
    extra: str  # pip extra that installs it
    health_path: str = "/health"
    needs_gpu: bool = True

    def argv(self, role: ServerRole, port: int, api_key: str | None, on_gpu: bool) -> list[str]:
        raise NotImplementedError


class SGLang(Backend):
    def argv(self, role, port, api_key, on_gpu):
        # Documented CLI: python -m sglang.launch_server --model-path --host --port --tp-size
        # --mem-fraction-static --random-seed --base-gpu-id (base 0: we slice CUDA_VISIBLE_DEVICES).
        cmd = [role.python, "-m", "sglang.launch_server", "--model-path", role.model_path]
        cmd += _revision(role)
        cmd += ["--host", role.host, "--port", str(port), "--tp-size", str(role.tp)]
        if role.pp > 1:
            cmd += ["--pp-size", str(role.pp)]
        cmd += ["--random-seed", str(role.seed), "--base-gpu-id", "0"]
        if not _has_flag(role.extra_args, "--mem-fraction-static"):
            cmd += ["--mem-fraction-static", "0.8"]
        if api_key:
            cmd += ["--api-key", api_key]
        return cmd + list(role.extra_args)


class VLLM(Backend):
    def argv(self, role, port, api_key, on_gpu):
        # Documented CLI: vllm serve MODEL --host --port --tensor-parallel-size
        # --pipeline-parallel-size --gpu-memory-utilization --seed --api-key
        vllm = str(Path(role.python).parent / "vllm")
        cmd = [vllm, "serve", role.model_path, "--host", role.host, "--port", str(port)]
        cmd += _revision(role)
        cmd += ["--tensor-parallel-size", str(role.tp)]
        if role.pp > 1:
            cmd += ["--pipeline-parallel-size", str(role.pp)]
        cmd += ["--seed", str(role.seed)]
        if not _has_flag(role.extra_args, "--gpu-memory-utilization"):
            cmd += ["--gpu-memory-utilization", "0.8"]
        if api_key:
            cmd += ["--api-key", api_key]
        return cmd + list(role.extra_args)


class HF(Backend):
    def argv(self, role, port, api_key, on_gpu):
        cmd = [role.python, "-m", "areal_cli.server", "--model-path", role.model_path]
        cmd += _revision(role)
        cmd += ["--host", role.host, "--port", str(port), "--seed", str(role.seed)]
        cmd += ["--device", "cuda" if on_gpu else "cpu"]
        if api_key:
            cmd += ["--api-key", api_key]
        return cmd + list(role.extra_args)


BACKENDS: dict[str, Backend] = {
    "sglang": SGLang("sglang", package="sglang", extra="sglang"),
    "vllm": VLLM("vllm", package="vllm", extra="vllm"),
    "hf": HF("hf", package="areal_cli.server", extra="", needs_gpu=False),
}


def get(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise UsageError(
            f"unknown backend {name!r}", hint=f"choose one of: {', '.join(BACKENDS)}"
        ) from None


def check_installed(backend: Backend, python: str) -> None:
    """Refuse early when the backend's package is missing from the interpreter that runs it."""
    import os
    import sys

    if backend.name == "hf" and os.path.realpath(python) == os.path.realpath(sys.executable):
        return  # our own interpreter runs our own server
    probe = (
        "import importlib.util, sys; "
        f"sys.exit(0 if importlib.util.find_spec({backend.package!r}) else 3)"
    )
    try:
        res = subprocess.run([python, "-c", probe], capture_output=True, timeout=60, check=False)
    except FileNotFoundError:
        raise UsageError(
            f"interpreter {python} does not exist", hint="--python takes the path of a python"
        ) from None
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UsageError(f"cannot run {python}: {e}") from None
    if res.returncode != 0:
        hint = (
            f"pip install 'areal-cli[{backend.extra}]' (or {backend.package}) into that "
            "environment, or point --python at an interpreter that has it"
            if backend.extra
            else "reinstall areal-cli into that environment"
        )
        raise UsageError(
            f"backend {backend.name!r} needs the {backend.package!r} package, which {python} "
            "cannot import",
            hint=hint,
        )


def _has_flag(args: tuple[str, ...], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _revision(role: ServerRole) -> list[str]:
    # sglang 0.5.23 (srt/arg_groups/fields/model.py `revision`), vLLM and our hf server all
    # take --revision for a hub id.
    return ["--revision", role.revision] if role.revision else []
