"""AReaL's own trainer under `areal train --areal-overrides`: what AReaL is installed in the
workers' interpreter, what its config asks for, and the overrides that version understands.

    target = probe(python, script_args)     # one short subprocess in --python
    overrides(target, backend, n_servers, train_alloc, experiment, trial, name_resolve)
    check_pairing(target, backend, entries) # refusals before any rank starts (UsageError)

AReaL ≥ 1.0 reads each engine's `backend` (`rollout.backend=sglang:d1`, `actor.backend=
fsdp:d2`; areal/trainer/rl_trainer.py) and refuses `allocation_mode`, a key its yamls no
longer hold; 0.5.x reads `allocation_mode=sglang:d1+fsdp:d2`. Every override is hydra's
add-or-override form (`++key=value`): AReaL composes the user's yaml with hydra
(areal/api/cli_args.py parse_cli_args), which refuses a plain `key=value` whose key the
yaml lacks. An hf server speaks SGLang's protocol: to AReaL it is `sglang`.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from areal_cli import backends
from areal_cli.errors import UsageError

# AReaL ≥ 1.0 is its own single controller unless this is set (areal/utils/environ.py
# is_single_controller); its own SPMD launcher sets it on every trainer
# (areal/infra/launcher/local.py), and without it PPOTrainer fails with
# "Unknown scheduler type: None".
SPMD_ENV = {"AREAL_SPMD_MODE": "1"}

# Asked of --python: AReaL's version, the SGLang version its `sglang` extra pins, and the
# sglang distribution installed beside it (metadata only: AReaL's trainer reads it in
# SGLangConfig.build_args even though it only speaks HTTP to remote servers).
_PROBE = r"""
import json, re
from importlib import metadata
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
pin = None
if version("areal"):
    for req in metadata.requires("areal") or []:
        m = re.match(r"sglang(\[[^\]]*\])?\s*==\s*([^;\s]+)", req)
        if m:
            pin = m.group(2)
print(json.dumps({"areal": version("areal"), "metadata": version("sglang"), "pin": pin}))
"""
PROBE_TIMEOUT = 60.0


@dataclass(frozen=True)
class Target:
    """AReaL in the workers' interpreter, and the parts of its config that matter here."""

    python: str
    version: str  # AReaL's version
    sglang: str | None  # the sglang distribution installed beside it (its metadata)
    sglang_pin: str | None  # what AReaL's `sglang` extra pins
    weight_update_mode: str | None = None  # actor.weight_update_mode (yaml, then overrides)
    config: str | None = None  # --config as given
    notes: list[str] = field(default_factory=list)

    @property
    def major(self) -> int:
        return _release(self.version)[0]

    def pin_hint(self) -> str:
        pin = f"=={self.sglang_pin}" if self.sglang_pin else ""
        return f"{self.python} -m pip install --no-deps 'sglang{pin}'"


def _release(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit()) or "0"
        out.append(int(digits))
    return tuple(out)


def ask(python: str) -> dict:
    """What `python` has installed (see _PROBE); UsageError when it cannot be asked."""
    try:
        out = subprocess.run(
            [python, "-c", _PROBE], capture_output=True, text=True, timeout=PROBE_TIMEOUT
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UsageError(f"--python {python}: cannot run it ({e})") from None
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise UsageError(f"--python {python}: cannot ask it what is installed ({tail})")
    return json.loads(out.stdout.strip().splitlines()[-1])


def config_path(script_args: list[str]) -> str | None:
    """AReaL's `--config FILE` (or `--config=FILE`) among the script's arguments."""
    for i, arg in enumerate(script_args):
        if arg == "--config" and i + 1 < len(script_args):
            return script_args[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def _override(script_args: list[str], key: str) -> str | None:
    """The last `key=value` the user gave for `key` (hydra's `+`/`++` forms too)."""
    found = None
    for arg in script_args:
        name, eq, value = arg.lstrip("+").partition("=")
        if eq and name == key:
            found = value
    return found


def read_config(path: str) -> dict:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise UsageError(f"--config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise UsageError(f"--config {path} is not YAML: {e}") from None
    return data if isinstance(data, dict) else {}


def probe(python: str, script_args: list[str]) -> Target:
    """AReaL in `python` and its config; UsageError (exit 2) when AReaL is not there."""
    got = ask(python)
    if not got.get("areal"):
        raise UsageError(
            f"--areal-overrides: AReaL is not installed in {python}",
            hint="give AReaL's interpreter with --python (e.g. --python "
            "/path/to/areal-venv/bin/python); scripts/areal-venv.sh builds one",
        )
    path = config_path(script_args)
    mode = None
    if path:
        actor = read_config(path).get("actor") or {}
        mode = actor.get("weight_update_mode") if isinstance(actor, dict) else None
    mode = _override(script_args, "actor.weight_update_mode") or mode
    return Target(
        python=python, version=got["areal"], sglang=got.get("metadata"),
        sglang_pin=got.get("pin"), weight_update_mode=mode, config=path,
    )  # fmt: skip


def overrides(
    version: str, backend: str, n_servers: int, train_alloc: str, experiment: str, trial: str,
    name_resolve: list[str],
) -> list[str]:  # fmt: skip
    """The overrides that point AReaL `version`'s trainer at our servers and registry.

    AReaL names its servers' entries `<user>/<experiment>/<trial>/gen_servers` and its disk
    sync's `.../update_weights_from_disk/<version>` with the experiment and trial of the
    engine that writes them (rollout.*, actor.*), so all of them are ours."""
    gen = f"{_areal_engine(backend).areal_engine}:d{max(1, n_servers)}"
    train = train_alloc.split("+")[-1]
    # Unknown (a dry run without AReaL in --python): the current form.
    legacy = bool(version) and _release(version)[0] < 1
    if legacy:
        placement = [f"allocation_mode={gen}+{train}"]
    else:
        placement = [f"rollout.backend={gen}", f"actor.backend={train}"]
    names = [
        f"experiment_name={experiment}", f"trial_name={trial}",
        f"rollout.experiment_name={experiment}", f"rollout.trial_name={trial}",
    ]  # fmt: skip
    if not legacy:
        names += [f"actor.experiment_name={experiment}", f"actor.trial_name={trial}"]
    return [f"++{kv}" for kv in (*placement, *names, *name_resolve)]


def _areal_engine(backend: str):
    """The engine AReaL's trainer takes a server of `backend` for (the fallback engine when
    none is named): an engine that speaks another's protocol is that one."""
    return backends.resolve(backends.resolve(backend).areal_engine)


def check_metadata(target: Target, backend: str) -> None:
    """AReaL's trainer builds SGLang's server arguments even for remote servers, and asks
    sglang's package metadata for its version there (areal/api/cli_args.py
    SGLangConfig.build_args): without it every rank dies at start."""
    if _areal_engine(backend).areal_reads_metadata and not target.sglang:
        raise UsageError(
            f"AReaL {target.version} in {target.python} needs sglang's package metadata "
            "to talk to SGLang servers (areal/api/cli_args.py SGLangConfig.build_args "
            "reads its version), and none is installed there",
            hint=f"install it without its dependencies: {target.pin_hint()}",
        )


def check_pairing(target: Target, backend: str, served: dict[str, str | None]) -> None:
    """Refuse AReaL's process-group weight sync (xccl) against SGLang servers of another
    version than AReaL pins: SGLang 0.5.23 takes /update_weights_from_distributed only
    inside a begin/end session that AReaL (pinned to 0.5.10.post1, which has none) never
    opens, so the sync fails inside AReaL's trainer. `served`: addr → engine version (None:
    not known)."""
    engine = backends.find(backend)
    strict = engine is not None and engine.update_session_required
    if not strict or target.weight_update_mode != "xccl" or not target.sglang_pin:
        return
    other = {a: v for a, v in served.items() if v and v != target.sglang_pin}
    if not other:
        return
    versions = ", ".join(sorted({f"SGLang {v}" for v in other.values()}))
    raise UsageError(
        f"AReaL {target.version} syncs weights over a process group "
        f"(actor.weight_update_mode=xccl) the way SGLang {target.sglang_pin} takes them, "
        f"and {', '.join(other)} serve{'s' if len(other) == 1 else ''} {versions}: the "
        "sync would fail inside AReaL's trainer",
        hint="sync by disk (add actor.weight_update_mode=disk to the script's arguments), "
        f"or serve SGLang {target.sglang_pin}, the version AReaL pins (areal serve "
        "--backend sglang --python <a venv with that sglang>)",
    )
