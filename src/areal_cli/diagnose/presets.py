"""Debug environment presets: loaded from templates/env_presets.yaml (the one source of truth),
rendered for shells, checked for combinations that do nothing or harm, and run around a command.

    preset_env("hang")  -> {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", ...}
    preset_names()      -> ["compile", "crash", "hang", "nccl", "nccl-bisect", "perf"]
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from areal_cli.errors import UsageError

SHELLS = ("bash", "fish", "json", "dotenv")
TRANSPORT_SWITCHES = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE")
FR_BUFFERS = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE")
# Variables whose value is a file path (or path prefix): their directory must exist.
PATH_VARS = ("NCCL_DEBUG_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE")


@dataclass(frozen=True)
class Var:
    name: str
    value: str
    meaning: str


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    vars: tuple[Var, ...]

    def env(self) -> dict[str, str]:
        return {v.name: v.value for v in self.vars}


@dataclass(frozen=True)
class Warning_:
    """A combination that does nothing or harms. `source` says where the variable came from."""

    message: str
    fix: str
    source: str  # "preset" | "environment"

    def to_json(self) -> dict:
        return {"message": self.message, "fix": self.fix, "source": self.source}


# --------------------------------------------------------------------------- loading


def presets_file() -> Path:
    return Path(str(resources.files("areal_cli.templates").joinpath("env_presets.yaml")))


@functools.lru_cache(maxsize=1)
def load_presets() -> dict[str, Preset]:
    import yaml

    path = presets_file()
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise UsageError(f"cannot read the env presets at {path}: {e}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a mapping of preset names")
    raw = {str(k): v for k, v in data.items()}
    out: dict[str, Preset] = {}
    for name in raw:
        out[name] = _build(name, raw, path, ())
    return out


def _build(name: str, raw: dict, path: Path, chain: tuple[str, ...]) -> Preset:
    if name in chain:
        raise UsageError(
            f"{path}: presets include each other in a loop: {' -> '.join(chain + (name,))}"
        )
    body = raw.get(name)
    if not isinstance(body, dict):
        raise UsageError(f"{path}: preset {name!r} must be a mapping with description and vars")
    merged: dict[str, Var] = {}
    for inc in body.get("include") or []:
        if inc not in raw:
            raise UsageError(f"{path}: preset {name!r} includes unknown preset {inc!r}")
        for v in _build(inc, raw, path, chain + (name,)).vars:
            merged[v.name] = v
    for var_name, spec in (body.get("vars") or {}).items():
        if not isinstance(spec, dict) or "value" not in spec:
            raise UsageError(f"{path}: {name}.{var_name} needs a value and a meaning")
        value = spec["value"]
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            # YAML turns bare ON/OFF/yes/no into booleans; the variable wants the text.
            raise UsageError(f"{path}: {name}.{var_name}: quote the value ({value!r} is not text)")
        merged[var_name] = Var(str(var_name), str(value), str(spec.get("meaning", "")).strip())
    return Preset(name, " ".join(str(body.get("description", "")).split()), tuple(merged.values()))


def preset_names() -> list[str]:
    return sorted(load_presets())


def get_preset(name: str) -> Preset:
    presets = load_presets()
    if name not in presets:
        raise UsageError(
            f"unknown debug preset {name!r}",
            hint="valid presets: " + ", ".join(sorted(presets)),
        )
    return presets[name]


def preset_env(name: str) -> dict[str, str]:
    """The variables of a preset (UsageError listing the valid names for an unknown one)."""
    return get_preset(name).env()


# --------------------------------------------------------------------------- checks


def check(name: str, inherited: Mapping[str, str] | None = None) -> list[Warning_]:
    """Combinations that do nothing or harm in the environment the command will see: the
    inherited environment (default: this process's) overlaid with the preset."""
    preset = get_preset(name)
    inherited = dict(os.environ if inherited is None else inherited)
    mine = preset.env()
    env = {**inherited, **mine}

    def src(var: str) -> str:
        return "preset" if var in mine else "environment"

    found: list[Warning_] = []
    if _on(env.get("TORCH_NCCL_DUMP_ON_TIMEOUT")) and not any(
        _positive(env.get(b)) for b in FR_BUFFERS
    ):
        found.append(
            Warning_(
                "TORCH_NCCL_DUMP_ON_TIMEOUT=1 does nothing without a flight recorder buffer",
                "also set TORCH_FR_BUFFER_SIZE=20000 (and TORCH_NCCL_TRACE_BUFFER_SIZE=20000 for "
                "PyTorch <= 2.5), or use --preset hang",
                src("TORCH_NCCL_DUMP_ON_TIMEOUT"),
            )
        )
    if name != "nccl-bisect":
        left = [v for v in TRANSPORT_SWITCHES if _on(env.get(v))]
        if left:
            found.append(
                Warning_(
                    f"{', '.join(f'{v}=1' for v in left)} left on: NCCL falls back to slower "
                    "transports (IB off means TCP sockets) in every collective",
                    "unset " + " ".join(left),
                    src(left[0]),
                )
            )
    if name == "perf":
        slow = []
        if _on(env.get("CUDA_LAUNCH_BLOCKING")):
            slow.append(("CUDA_LAUNCH_BLOCKING", "every kernel launch waits for the GPU"))
        if _on(env.get("TORCH_NCCL_BLOCKING_WAIT")):
            slow.append(("TORCH_NCCL_BLOCKING_WAIT", "every collective's wait() blocks the CPU"))
        if (env.get("NCCL_DEBUG") or "").upper() in ("INFO", "TRACE"):
            slow.append(("NCCL_DEBUG", f"NCCL_DEBUG={env['NCCL_DEBUG']} logs in hot paths"))
        if (env.get("TORCH_DISTRIBUTED_DEBUG") or "").upper() == "DETAIL":
            slow.append(("TORCH_DISTRIBUTED_DEBUG", "DETAIL runs a check before every collective"))
        if _on(env.get("TORCHDYNAMO_VERBOSE")) or env.get("TORCH_LOGS"):
            slow.append(("TORCH_LOGS", "compile logging slows compilation"))
        for var, why in slow:
            found.append(Warning_(f"{var} in a perf run: {why}", f"unset {var}", src(var)))
    if env.get("NCCL_DEBUG_SUBSYS") and not env.get("NCCL_DEBUG"):
        found.append(
            Warning_(
                "NCCL_DEBUG_SUBSYS does nothing without NCCL_DEBUG",
                "set NCCL_DEBUG=INFO",
                src("NCCL_DEBUG_SUBSYS"),
            )
        )
    if env.get("NCCL_DEBUG_FILE") and not env.get("NCCL_DEBUG"):
        found.append(
            Warning_(
                "NCCL_DEBUG_FILE does nothing without NCCL_DEBUG",
                "set NCCL_DEBUG=INFO",
                src("NCCL_DEBUG_FILE"),
            )
        )
    if name != "crash" and _on(env.get("CUDA_LAUNCH_BLOCKING")) and name != "perf":
        found.append(
            Warning_(
                "CUDA_LAUNCH_BLOCKING=1 from the environment serializes every kernel and can hide "
                "the overlap that makes a hang happen",
                "unset CUDA_LAUNCH_BLOCKING unless you are chasing a crash",
                src("CUDA_LAUNCH_BLOCKING"),
            )
        )
    return found


def _on(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _positive(value: str | None) -> bool:
    try:
        return int((value or "0").strip()) > 0
    except ValueError:
        return False


# --------------------------------------------------------------------------- rendering


def render(name: str, shell: str) -> str:
    """The preset as text to eval (bash, fish), load (dotenv) or parse (json)."""
    if shell not in SHELLS:
        raise UsageError(f"unknown shell {shell!r}", hint="choose one of: " + ", ".join(SHELLS))
    preset = get_preset(name)
    env = preset.env()
    dirs = sorted({str(Path(env[v]).parent) for v in PATH_VARS if v in env})
    if shell == "json":
        return json.dumps(env, indent=2) + "\n"
    lines: list[str] = []
    if shell == "bash":
        lines.append(f"# areal debug preset: {name}")
        lines += [f"mkdir -p {shlex.quote(d)}" for d in dirs]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    elif shell == "fish":
        lines.append(f"# areal debug preset: {name}")
        lines += [f"mkdir -p {_fish_quote(d)}" for d in dirs]
        lines += [f"set -gx {k} {_fish_quote(v)}" for k, v in env.items()]
    else:  # dotenv: no commands, directories are the reader's job (or `doctor env -- CMD`)
        lines.append(f"# areal debug preset: {name}")
        lines += [f"{k}={_dotenv_quote(v)}" for k, v in env.items()]
    return "\n".join(lines) + "\n"


def _fish_quote(v: str) -> str:
    return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _dotenv_quote(v: str) -> str:
    if v and all(c.isalnum() or c in "_-.,/:%+@" for c in v):
        return v
    return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$") + '"'


# --------------------------------------------------------------------------- running


def prepare_paths(env: Mapping[str, str]) -> list[Path]:
    """Create the directories that path-valued variables point into (NCCL and the flight
    recorder write there but do not create them). Returns the directories."""
    made = []
    for v in PATH_VARS:
        if env.get(v):
            d = Path(env[v]).expanduser().parent
            d.mkdir(parents=True, exist_ok=True)
            made.append(d)
    return made


def run_with_preset(name: str, argv: list[str]) -> int:
    """Run argv with the preset on top of this environment and return its exit code (128+N when
    signal N killed it). A program that does not exist is a UsageError."""
    if not argv:
        raise UsageError(
            "no command given after --", hint="areal doctor env --preset hang -- python train.py"
        )
    env = {**os.environ, **preset_env(name)}
    prepare_paths(env)
    try:
        # Same process group: Ctrl-C reaches the command directly; we only wait for it.
        proc = subprocess.Popen(argv, env=env)
    except FileNotFoundError:
        raise UsageError(
            f"command not found: {argv[0]}", hint="check the spelling or give a full path"
        ) from None
    except PermissionError:
        raise UsageError(f"cannot execute {argv[0]}: permission denied") from None
    previous = signal.signal(signal.SIGTERM, lambda s, f: proc.send_signal(signal.SIGTERM))
    try:
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:
                continue  # the child got the same SIGINT; its exit code is the answer
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 128 - code if code < 0 else code
