"""From what a user asked for (flags and the job YAML, already merged) to a JobSpec: each
rule that makes a serve or train request well formed is one function here. The commands
are parse flags → these → Scheduler.dryrun → run; nothing here prints.

The allocation is parsed once, here, and travels in the spec as the parsed object
(JobSpec.allocation); the registry is the scheduler's one opened object."""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from areal_cli import backends, discovery, gpus, models, schedulers, settings
from areal_cli.alloc import Allocation, parse
from areal_cli.diagnose import watchdog
from areal_cli.errors import UsageError
from areal_cli.spec import Asked, JobSpec, SchedulerOpts, ServerRole, TrainerRole

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
    from areal_cli.diagnose import presets  # only for a preset

    env = dict(presets.preset_env(preset))
    if prepare:
        presets.prepare_paths(env)
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
    ref = models.parse(str(model))
    return ServerRole(
        backend=comp.backend, model_path=ref.name, revision=ref.revision,
        replicas=comp.d, tp=comp.t, pp=comp.p, python=python,
    )  # fmt: skip


def servers_given(servers: str, api_key: str | None):
    """--servers none | host:port,...: the servers found without the registry (None for
    auto, which asks the registry)."""
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
    from areal_cli import control  # http.client and ssl: not paid by a job that fails earlier

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
    from areal_cli import areal_entry  # only for --areal-overrides

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
    text = str(value).strip()
    if text.lower() == watchdog.AUTO:
        return watchdog.DEFAULT_SECONDS, True
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
    if action not in watchdog.ACTIONS:
        raise UsageError(
            f"--watchdog-action {action!r} is not one of {', '.join(watchdog.ACTIONS)}",
            hint="observe keeps the job running; fail stops it on a stall (exit 1)",
        )
    return action


def restart_on(value: str) -> str:
    # The doctor's root-cause rules come with it: not paid by a job that fails earlier.
    from areal_cli.diagnose import restart

    if value not in restart.RESTART_ON:
        raise UsageError(
            f"--restart-on {value!r} is not one of {', '.join(restart.RESTART_ON)}",
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
    return backends.default_for(bool(gpus.detect(gpus_flag and str(gpus_flag)).gpus))


def serve_alloc_text(role: ServerRole) -> str:
    """The allocation a --dp/--tp request stands for."""
    return f"{role.backend}:d{role.replicas}t{role.tp}" + (f"p{role.pp}" if role.pp > 1 else "")


# --------------------------------------------------------------------------- the request

NAME_MAX = 100  # names become directory names and registry keys; 255 bytes is the file limit


def check_name(kind: str, value: str) -> str:
    """Experiment and trial names: ASCII letters, digits, '-', '_', '.', not starting with
    '-' (it would read as an option) or '.' (hidden, and '..'), at most NAME_MAX long."""
    shown = value if len(value) <= 40 else value[:40] + "..."
    if len(value) > NAME_MAX:
        raise UsageError(
            f"{kind} name {shown!r} is {len(value)} characters long",
            hint=f"use at most {NAME_MAX}",
        )
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", value or ""):
        raise UsageError(
            f"{kind} name {shown!r} is not usable",
            hint="use ASCII letters, digits, '-', '_' and '.', starting with a letter, digit or '_'",
        )
    return value


def job_names(asked: Asked) -> tuple[str, str]:
    """--experiment and --trial, checked; their defaults are the settings' (an empty name
    given is refused, not replaced)."""
    experiment, trial = asked["experiment"], asked["trial"]
    return (
        check_name("experiment", settings.DEFAULT_EXPERIMENT if experiment is None else experiment),
        check_name("trial", settings.DEFAULT_TRIAL if trial is None else trial),
    )


def seconds(flag: str, value) -> float:
    """A duration from a flag or the config: finite and positive (`nan` and `inf` parse as
    floats and slip through a range check)."""
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"{flag} {value:g} is not a number of seconds >= 0")
    return value


def python_default() -> str:
    return os.environ.get("AREAL_PYTHON") or sys.executable


def scheduler_opts(sched, asked: Asked) -> SchedulerOpts:
    """The options of `sched`, from the flags of the schedulers' options (RunOpt.flag),
    `--scheduler-opt KEY=VALUE`, and the job YAML (`scheduler_opts:` or a flag's key), checked
    against what the scheduler declares (Scheduler.runopts): one it does not take is a usage
    error naming those it does. One not given is its declared default."""
    declared = {o.name: o for o in sched.runopts}
    flagged = {o.name: o.flag for o in schedulers.flagged_runopts()}
    yaml = asked.job_yaml
    given: dict[str, tuple[str, object]] = {}
    for key in flagged:
        if yaml.get(key) not in (None, []):
            given[key] = (f"{key} in the job YAML", yaml[key])
    for key, value in (yaml.get("scheduler_opts") or {}).items():
        given[key] = (f"scheduler_opts.{key} in the job YAML", value)
    for item in asked["scheduler_opt"] or ():
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise UsageError(
                f"--scheduler-opt {item!r} is not KEY=VALUE",
                hint="e.g. --scheduler-opt address=HEAD:6379",
            )
        if key in declared and declared[key].kind == "list":
            before = given.get(key, ("", []))[1] if key in given else []
            value = [*(before if isinstance(before, list) else [before]), value]
        given[key] = (f"--scheduler-opt {key}", value)
    for key, value in asked.given(flagged).items():
        if value not in (None, [], ()):
            given[key] = (flagged[key], value)
    values = {o.name: o.default for o in sched.runopts if o.default is not None}
    for key, (where, value) in given.items():
        if key not in declared:
            raise _not_an_option(sched, key, where)
        values[key] = _runopt_value(declared[key], value, where)
    return SchedulerOpts(tuple(sorted(values.items())))


def _not_an_option(sched, key: str, where: str) -> UsageError:
    chosen = sched.name
    known = ", ".join(f"{o.name} ({o.help})" for o in sched.runopts) or "none"
    owners = [n for n in schedulers.names() if n != chosen and _declares(n, key)]
    also = (
        f"it is an option of {' and '.join(owners)}: add --scheduler {owners[0]} (or "
        f"scheduler: {owners[0]} in the job YAML); "
        if owners
        else ""
    )
    return UsageError(
        f"{where}: not an option of the {chosen} scheduler",
        hint=f"{also}the {chosen} scheduler takes: {known}",
    )


def _declares(name: str, key: str) -> bool:
    try:
        return any(o.name == key for o in schedulers.scheduler_class(name).runopts)
    except UsageError:
        return False


def _runopt_value(opt, value, where: str):
    if opt.kind == "list":
        items = value if isinstance(value, (list, tuple)) else [value]
        return tuple(str(x) for x in items)
    if isinstance(value, (list, tuple, dict)):
        raise UsageError(f"{where}: {opt.name} takes one value")
    if opt.kind == "posint":
        try:
            n = int(str(value))
        except ValueError:
            n = 0
        if n < 1 or isinstance(value, bool):
            raise UsageError(f"{where}: {opt.name} is {value!r}, not an integer >= 1")
        return n
    return str(value)


# find(servers, api_key, experiment, trial, need, wait) -> discovery.Found: the servers a
# training-only job uses (the command shows the wait and what was found).
FindServers = Callable[[str, str, str, str, int, float], "discovery.Found"]


def train_spec(asked: Asked, script: str, script_args: list[str], sched,
               find: FindServers) -> JobSpec:  # fmt: skip
    """The JobSpec of `areal train`: the trainers, the servers they start or use, the
    watchdog and restart rules, where the job runs."""
    where = scheduler_opts(sched, asked)
    allocation = train_allocation(asked["alloc"])
    python = asked["python"] or python_default()
    trainer = trainer_role(
        script, script_args, allocation, int(asked["nnodes"]), node_rank=int(asked["node_rank"]),
        master_addr=str(asked["master_addr"]), master_port=asked["master_port"], python=python,
        areal_overrides=bool(asked["areal_overrides"]),
    )  # fmt: skip
    experiment, trial = job_names(asked)
    dry_run = asked["dry_run"]
    env = debug_env(asked["debug_preset"], not dry_run)
    trainer = replace(trainer, env=tuple(env.items()))
    servers = colaunched_servers(allocation, asked["model"], python)
    key = str(asked["api_key"])
    found = None
    if servers is None:
        found = find(str(asked["servers"]), key, experiment, trial,
                     int(asked["min_servers"]), asked["wait_servers"])  # fmt: skip
    check_overrides_key(servers, trainer.areal_overrides, key)
    if found is not None and found.addrs and not dry_run:
        found = checked_keys(found, trainer.areal_overrides, explicit_key(key))
    if trainer.areal_overrides:
        trainer = areal_trainer(
            trainer, servers, found, dry_run, sched.opened_registry(), (experiment, trial)
        )
    limit_s, auto = watchdog_limit(asked["watchdog"])
    return JobSpec(
        watchdog=limit_s,
        watchdog_auto=auto,
        watchdog_action=watchdog_action(str(asked["watchdog_action"])),
        max_restarts=int(asked["max_restarts"]),
        restart_on=restart_on(str(asked["restart_on"])),
        experiment=experiment,
        trial=trial,
        servers=servers,
        trainer=trainer,
        alloc=allocation.text,
        allocation=allocation,
        gpus_flag=asked["gpus"],
        api_key=key,
        health_timeout=seconds("--health-timeout", asked["health_timeout"]),
        external_servers=tuple(found.addrs) if found else (),
        external_backend=found.backend if found else None,
        external_api_key=found.api_key if found else None,
        scheduler_opts=where,
    )


def serve_spec(asked: Asked, extra_args: list[str], sched) -> tuple[JobSpec, list[str], list[str]]:
    """The JobSpec of `areal serve`, the notes its plan shows first, and those of them that
    say where a flag rewrote the job YAML (a run shows these too)."""
    where = scheduler_opts(sched, asked)
    model = asked["model"]
    if not model:
        raise UsageError("--model is required", hint="areal serve --model /path/to/model")
    # A dry run plans without the model: on a cluster it may exist on the nodes only.
    ref = models.parse(str(model), missing_ok=asked["dry_run"])
    notes = [] if ref.found else [f"model {ref.name} not found on this host"]
    keys = ("alloc", "backend", "dp", "tp")
    shape, rewritten = serve_shape(asked.given(keys), asked.job_yaml)
    notes += rewritten
    allocation, backend, dp, tp, pp = serve_allocation(
        shape.get("alloc"), shape.get("backend"), shape.get("dp"), shape.get("tp")
    )
    gpus_flag = asked["gpus"]
    role = ServerRole(
        backend=backend or default_backend(gpus_flag),
        model_path=ref.name,
        revision=ref.revision,
        replicas=dp or 1,
        tp=tp or 1,
        pp=pp,
        host=asked["host"],
        port_base=asked["port_base"],
        python=asked["python"] or python_default(),
        extra_args=tuple(extra_args or asked.job_yaml.get("extra_args", [])),
        seed=int(asked["seed"]),
        allow_unauthenticated_control=bool(asked["allow_unauthenticated_control"]),
        max_restarts=restart_budget(asked["max_restarts"]),
    )
    experiment, trial = job_names(asked)
    spec = JobSpec(
        experiment=experiment,
        trial=trial,
        servers=role,
        alloc=allocation.text if allocation else serve_alloc_text(role),
        allocation=allocation,
        gpus_flag=None if gpus_flag is None else str(gpus_flag),
        api_key=str(asked["api_key"]),
        health_timeout=seconds("--health-timeout", asked["health_timeout"]),
        scheduler_opts=where,
    )
    return spec, notes, rewritten
