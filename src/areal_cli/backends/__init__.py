"""Inference backends: how to launch one replica and how to tell it is ready.

Each backend turns (role, port, host) into the argv and environment of one server replica.
GPUs are handed over by CUDA_VISIBLE_DEVICES slices, so every replica counts its GPUs from 0.
Flags are those of sglang 0.5.23 (srt/arg_groups/fields/*.py, one flag per field name) and
vllm 0.33 (engine/arg_utils.py).

An API key never goes on a command line, which every local user reads in /proc/PID/cmdline:
    hf      AREAL_SERVER_API_KEY in its environment (server/__main__.py)
    vllm    VLLM_API_KEY in its environment (vllm/envs.py:829, middleware/register.py:32-36)
    sglang  0.5.23 takes it only as --api-key or from a --config YAML file
            (srt/server_args.py:400-405, 683-689): `sglang_launch` feeds it that file through
            a FIFO from AREAL_SERVER_API_KEY, so it lands neither on disk nor in argv
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from areal_cli.errors import UsageError
from areal_cli.spec import ServerRole

KEY_ENV = "AREAL_SERVER_API_KEY"


@dataclass(frozen=True)
class Backend:
    name: str
    package: str  # importable module that must exist in the server's interpreter
    extra: str  # pip extra that installs it
    health_path: str = "/health"
    needs_gpu: bool = True
    key_env: str = KEY_ENV  # the variable the server reads its API key from

    def argv(self, role: ServerRole, port: int, api_key: str | None, on_gpu: bool) -> list[str]:
        """The replica's command line; `api_key` only says whether there is one (it goes
        in the environment, see `env`)."""
        raise NotImplementedError

    def env(self, role: ServerRole, api_key: str | None = None) -> dict[str, str]:
        """Environment the replica needs on top of the caller's, the API key included."""
        env = self.fixed_env(role)
        if api_key:
            env[self.key_env] = api_key
        return env

    def fixed_env(self, role: ServerRole) -> dict[str, str]:
        return {}

    def check_bind(self, role: ServerRole) -> None:
        """Refuse a bind address that would expose what nothing guards."""


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
        cmd += list(role.extra_args)
        if api_key:
            # Runs with our interpreter (the servers' may not have areal_cli), then execs SGLang.
            return [sys.executable, "-m", "areal_cli.backends.sglang_launch", "--", *cmd]
        return cmd


class VLLM(Backend):
    """vLLM 0.33, set up to be trained: the servers `areal serve` starts are the ones a
    trainer pauses and updates.

    - Its pause, resume, collective_rpc, weight-version and weight-transfer routes exist only
      with VLLM_SERVER_DEV_MODE=1 (entrypoints/launchers/api_server/routers.py:46-53), and
      its --api-key guards only /v1, /v2, /inference and /cohere
      (entrypoints/serve/middleware/authenticate.py:11): so such a server is bound beyond
      loopback only when the user says `--allow-unauthenticated-control`.
    - `--logprobs-mode processed_logprobs`: the default (raw_logprobs, config/model.py:291)
      reports logprobs before temperature, not those of the distribution it sampled from.
    - `--generation-config vllm`: the default ("auto", config/model.py:358-364) lets the
      model's generation_config.json change sampling defaults behind the trainer's back.
    - `--weight-transfer-config {"backend": "nccl"}`: without it /init_weight_transfer_engine
      fails (v1/worker/gpu_worker.py:1512-1517).
    """

    ARGS = (
        ("--logprobs-mode", "processed_logprobs"),
        ("--generation-config", "vllm"),
        ("--weight-transfer-config", '{"backend": "nccl"}'),
    )

    def argv(self, role, port, api_key, on_gpu):
        # vllm serve MODEL --host --port --tensor-parallel-size --pipeline-parallel-size
        # --seed --gpu-memory-utilization --api-key (engine/arg_utils.py:978-1389)
        vllm = str(Path(role.python).parent / "vllm")
        cmd = [vllm, "serve", role.model_path, "--host", role.host, "--port", str(port)]
        cmd += _revision(role)
        cmd += ["--tensor-parallel-size", str(role.tp)]
        if role.pp > 1:
            cmd += ["--pipeline-parallel-size", str(role.pp)]
        cmd += ["--seed", str(role.seed)]
        if not _has_flag(role.extra_args, "--gpu-memory-utilization"):
            cmd += ["--gpu-memory-utilization", "0.8"]
        for flag, value in self.ARGS:
            if not _has_flag(role.extra_args, flag):
                cmd += [flag, value]
        return cmd + list(role.extra_args)

    def fixed_env(self, role):
        return {"VLLM_SERVER_DEV_MODE": "1"}

    def check_bind(self, role):
        if getattr(role, "allow_unauthenticated_control", False) or _is_loopback(role.host):
            return
        raise UsageError(
            f"a vLLM server on {role.host} would let anyone who reaches it pause it and load "
            "other weights: the trainer needs its control routes (VLLM_SERVER_DEV_MODE=1), "
            "and vLLM's --api-key does not cover them (only /v1, /v2, /inference, /cohere)",
            hint="bind to 127.0.0.1, or pass --allow-unauthenticated-control on a network "
            "you trust",
        )


class HF(Backend):
    def argv(self, role, port, api_key, on_gpu):
        cmd = [role.python, "-m", "areal_cli.server", "--model-path", role.model_path]
        cmd += _revision(role)
        cmd += ["--host", role.host, "--port", str(port), "--seed", str(role.seed)]
        cmd += ["--device", "cuda" if on_gpu else "cpu"]
        return cmd + list(role.extra_args)


BACKENDS: dict[str, Backend] = {
    "sglang": SGLang("sglang", package="sglang", extra="sglang"),
    "vllm": VLLM("vllm", package="vllm", extra="vllm", key_env="VLLM_API_KEY"),
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


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _revision(role: ServerRole) -> list[str]:
    # sglang 0.5.23 (srt/arg_groups/fields/model.py `revision`), vLLM and our hf server all
    # take --revision for a hub id.
    return ["--revision", role.revision] if role.revision else []
