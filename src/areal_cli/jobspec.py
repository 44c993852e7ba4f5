"""From what a user asked for (flags and the job YAML, already merged) to a JobSpec: each
rule that makes a serve or train request well formed is one function here. The commands
are parse flags → these → Scheduler.dryrun → run; nothing here prints.

The allocation is parsed once, here, and travels in the spec as the parsed object
(JobSpec.allocation); the registry is the scheduler's one opened object."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from areal_cli.alloc import Allocation, parse
from areal_cli.errors import UsageError
from areal_cli.spec import ServerRole, TrainerRole

# --------------------------------------------------------------------------- train


def train_allocation(text: str | None) -> Allocation:
    """--alloc of a training job: given, valid, and with a train component."""
    if not text:
        raise UsageError("--alloc is required", hint="e.g. areal train --alloc fsdp:d2 train.py")
    a = parse(text)
    if a.train is None:
        raise UsageError(
            f"--alloc {text} has no train component",
            hint="add one, e.g. fsdp:d2 (training only) or " + text + "+fsdp:d2",
        )
    return a


def check_script(script: str, script_args: list[str]) -> None:
    """A script that exists, or torchrun's own `-m pkg.mod ARGS` in its place."""
    if script == "-m":
        if not script_args:
            raise UsageError(
                "-m needs a module name", hint="areal train --alloc fsdp:d2 -- -m pkg.train ARGS"
            )
    elif not Path(script).is_file():
        raise UsageError(
            f"script {script} does not exist", hint="give the path of a training script"
        )


def ranks_per_node(allocation: Allocation, nnodes: int) -> int:
    world = allocation.train.world_size
    if world % nnodes:
        raise UsageError(
            f"{allocation.text}: world size {world} does not split over {nnodes} nodes"
        )
    return world // nnodes


def debug_env(preset: str | None, prepare: bool) -> dict[str, str]:
    """The environment of a `--debug-preset`; `prepare`: make the folders it writes to (NCCL
    and the flight recorder write there, never mkdir)."""
    if not preset:
        return {}
    from areal_cli.diagnose.presets import prepare_paths, preset_env

    env = dict(preset_env(preset))
    if prepare:
        prepare_paths(env)
    return env


def colaunched_servers(allocation: Allocation, model: str | None, python: str) -> ServerRole | None:
    """The servers a combined allocation (hf:d1+fsdp:d2) starts with the trainers."""
    if not allocation.inference:
        return None
    if len(allocation.inference) != 1:
        raise UsageError("train co-launches one inference component", hint="e.g. hf:d1+fsdp:d2")
    comp = allocation.inference[0]
    if not model:
        raise UsageError(
            f"--alloc {allocation.text} starts {comp.backend} servers: --model is required"
        )
    from areal_cli import models

    ref = models.parse(str(model))
    return ServerRole(
        backend=comp.backend, model_path=ref.name, revision=ref.revision,
        replicas=comp.d, tp=comp.t, pp=comp.p, python=python,
    )  # fmt: skip


def servers_given(servers: str, api_key: str | None):
    """--servers none | host:port,...: the servers found without the registry (None for
    auto, which asks the registry)."""
    from areal_cli import discovery

    if servers == "none":
        return discovery.Found([], "", None, [])
    if servers == "auto":
        return None
    return discovery.explicit(discovery.parse_addrs(servers), None, explicit_key(api_key))


def servers_from_registry(
    registry,
    home: Path,
    experiment: str,
    trial: str,
    need: int,
    wait: float,
    progress: Callable[[int, float], None] | None,
    dry_run: bool,
):
    """The healthy servers E/T registered, waiting up to `wait` seconds for `need` of them.
    A dry run shows the plan even where none answer."""
    from areal_cli import backends, discovery

    try:
        return discovery.from_registry(registry, home, experiment, trial, need, wait, progress)
    except Exception:
        if not dry_run:
            raise
        return discovery.Found([], backends.FALLBACK, None, [])


def check_overrides_key(servers: ServerRole | None, areal_overrides: bool, key: str | None):
    if servers is not None and areal_overrides and key != "none":
        raise UsageError(
            "--areal-overrides: AReaL's trainer sends no API key, and the servers this "
            "job starts would want one (--api-key auto)",
            hint="add --api-key none (any user of this host can then reach the servers), "
            "or train with areal_cli.worker, which sends the key",
        )


def checked_keys(found, areal: bool, given: str | None):
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


def areal_trainer(trainer: TrainerRole, servers: ServerRole | None, found, dry_run: bool,
                  registry=None, name: tuple[str, str] | None = None):  # fmt: skip
    """`trainer` with the AReaL version of its interpreter, once what stands in the way of
    AReaL's trainer against these servers is refused (areal_entry). A dry run plans without
    AReaL installed (the current release's overrides). Before a run, what an earlier AReaL
    trainer left under the trial `name` in `registry` goes, as AReaL's own launcher clears
    it: a stale `update_weights_from_disk/<n>` would send the servers to load weights not
    yet written."""
    from areal_cli import areal_entry, backends

    try:
        target = areal_entry.probe(trainer.python, list(trainer.script_args))
    except UsageError:
        if dry_run:
            return trainer
        raise
    backend = servers.backend if servers else (found.backend if found else backends.FALLBACK)
    if not dry_run:
        areal_entry.check_metadata(target, backend)
        served = {e.addr: e.engine_version for e in (found.entries if found else [])}
        areal_entry.check_pairing(target, backend, served)
        if registry is not None and name is not None:
            registry.clear_foreign(*name)
    return replace(trainer, areal_version=target.version)


def explicit_key(flag: str | None) -> str | None:
    """The key for servers given with --servers: the flag's KEY, else AREAL_API_KEY."""
    if flag and flag not in ("auto", "none"):
        return flag
    return None if flag == "none" else (os.environ.get("AREAL_API_KEY") or None)


def watchdog_limit(value) -> tuple[float, bool]:
    """--watchdog (or the YAML key): auto (the default) | SECONDS | 0 (off), as (seconds,
    auto): auto's seconds are its limit before steps are timed and its ceiling."""
    import math

    from areal_cli.diagnose.watchdog import AUTO, DEFAULT_SECONDS

    text = str(value).strip()
    if text.lower() == AUTO:
        return DEFAULT_SECONDS, True
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise UsageError(
            f"--watchdog {text!r} is not auto, a number of seconds >= 0 or 0 (off)",
            hint="auto follows the job's step time; SECONDS is a fixed limit",
        )
    return seconds, False


def watchdog_action(action: str) -> str:
    from areal_cli.diagnose.watchdog import ACTIONS

    if action not in ACTIONS:
        raise UsageError(
            f"--watchdog-action {action!r} is not one of {', '.join(ACTIONS)}",
            hint="observe keeps the job running; fail stops it on a stall (exit 1)",
        )
    return action


def restart_on(value: str) -> str:
    from areal_cli.diagnose.restart import RESTART_ON

    if value not in RESTART_ON:
        raise UsageError(
            f"--restart-on {value!r} is not one of {', '.join(RESTART_ON)}",
            hint="infra restarts on faults of the infrastructure only (the doctor's root "
            "cause decides); any restarts on every failure",
        )
    return value


def trainer_role(script: str, script_args: list[str], allocation: Allocation, nnodes: int,
                 **fields) -> TrainerRole:  # fmt: skip
    """torchrun's workers of the train component, `fields` the rest of TrainerRole."""
    check_script(script, script_args)
    return TrainerRole(
        script=script, script_args=tuple(script_args), alloc=allocation.text,
        nproc=ranks_per_node(allocation, nnodes), nnodes=nnodes, **fields,
    )  # fmt: skip


# --------------------------------------------------------------------------- serve


def serve_allocation(text: str | None, backend: str | None, dp, tp):
    """--alloc (one inference component) or --dp/--tp, agreeing with --backend:
    (the parsed allocation or None, backend, dp, tp, pp)."""
    if not text:
        return None, backend, dp, tp, 1
    if dp or tp:
        raise UsageError("give either --alloc or --dp/--tp, not both")
    a = parse(text)
    if a.train is not None:
        raise UsageError(
            f"--alloc {text} has a train component ({a.train.backend}); serve starts servers only",
            hint="start training with `areal train --alloc " + text + " SCRIPT`",
        )
    if len(a.inference) != 1:
        raise UsageError("serve takes one inference component", hint="e.g. sglang:d2t2")
    comp = a.inference[0]
    if backend and backend != comp.backend:
        raise UsageError(f"--backend {backend} disagrees with --alloc {text}")
    return a, comp.backend, comp.d, comp.t, comp.p


def restart_budget(value) -> int:
    """`--max-restarts` of servers (a config file's value too): restarts per hour, >= 0."""
    if int(value) < 0:
        raise UsageError(f"max_restarts must be 0 (off) or more, not {value}",
                         hint="restarts of a replica per rolling hour, e.g. 3")  # fmt: skip
    return int(value)


def serve_shape(flags: dict, config: dict) -> tuple[dict, list[str]]:
    """alloc, backend, dp and tp from the flags and the job YAML, and a note for each YAML
    value a flag rewrote.

    The four determine one another, so a flag wins together with what it determines: --alloc
    replaces the YAML's backend/dp/tp, and --backend, --dp or --tp rewrite that part of the
    YAML's alloc (`--backend hf` over `alloc: sglang:d4t1` plans hf:d4t1). Flags among
    themselves are still checked against each other (serve_allocation)."""
    keys = ("alloc", "backend", "dp", "tp")
    given = {k: flags.get(k) for k in keys if flags.get(k) is not None}
    from_yaml = {k: config[k] for k in keys if config.get(k) is not None and k not in given}
    notes = []
    if "alloc" in given:
        # What the flag's alloc says (serve_allocation judges it; no YAML key, no question).
        yaml_keys = [k for k in ("backend", "dp", "tp") if k in from_yaml]
        try:
            comp = _one_inference(str(given["alloc"])) if yaml_keys else None
        except UsageError:
            comp = None
        said = {"backend": comp.backend, "dp": comp.d, "tp": comp.t} if comp else {}
        dropped = [k for k in yaml_keys if from_yaml[k] != said.get(k)]
        if dropped:
            notes.append(
                f"--alloc {given['alloc']} replaces the job YAML's "
                + ", ".join(f"{k}: {from_yaml[k]}" for k in dropped)
            )
        return {**given}, notes
    if "alloc" in from_yaml and given:
        before = str(from_yaml["alloc"])
        comp = _one_inference(before)
        after = (
            f"{given.get('backend', comp.backend)}:d{given.get('dp', comp.d)}"
            f"t{given.get('tp', comp.t)}" + (f"p{comp.p}" if comp.p > 1 else "")
        )
        if after != before:
            flags_text = " ".join(f"--{k} {v}" for k, v in given.items())
            notes.append(f"{flags_text} rewrote the job YAML's alloc {before} as {after}")
        return {"alloc": after}, notes
    return {**from_yaml, **given}, notes


def _one_inference(text: str):
    a = parse(text)
    if a.train is not None or len(a.inference) != 1:
        raise UsageError(
            f"alloc {text} is not one inference component", hint="e.g. alloc: sglang:d2t2"
        )
    return a.inference[0]


def default_backend(gpus_flag: str | None) -> str:
    """The engine that says it is the default where there are GPUs (SGLang), or on a host
    without them (hf)."""
    from areal_cli import backends, gpus

    return backends.default_for(bool(gpus.detect(gpus_flag and str(gpus_flag)).gpus))


def serve_alloc_text(role: ServerRole) -> str:
    """The allocation a --dp/--tp request stands for."""
    return f"{role.backend}:d{role.replicas}t{role.tp}" + (f"p{role.pp}" if role.pp > 1 else "")
