"""Pieces every command shares: name options, config files, log prefixes, plan rendering."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import typer

from areal_cli import settings
from areal_cli.errors import UsageError

# Defaults are applied after the config file is read (flag > config > default), so the
# options themselves default to None.
ExperimentOpt = typer.Option(
    None, "--experiment", "-e", help=f"Experiment name (default: {settings.DEFAULT_EXPERIMENT})."
)
TrialOpt = typer.Option(
    None, "--trial", "-t", help=f"Trial name (default: {settings.DEFAULT_TRIAL})."
)
HomeOpt = typer.Option(
    None, "--home", help="Job records and logs (env AREAL_HOME; default ~/.cache/areal)."
)


def _use_registry(value: str | None) -> str | None:
    """--registry stands for AREAL_REGISTRY in this command, wherever it reads the registry
    (a job's own records name theirs; this one is where new entries go and what is asked)."""
    if value:
        settings.use_registry(value)
    return value


# One definition for every command that reads or writes the registry.
RegistryOpt = typer.Option(
    None,
    "--registry",
    callback=_use_registry,
    help=f"Registry: a directory or etcd://HOST:PORT (env AREAL_REGISTRY; default {settings.DEFAULT_REGISTRY}).",
)
JsonOpt = typer.Option(False, "--json", help="Machine-readable output on stdout.")
SchedulerOpt = typer.Option(
    None,
    "--scheduler",
    help="local | slurm | ray, or one an installed plug-in adds (env AREAL_SCHEDULER; "
    "default local).",
)
SchedulerOptOpt = typer.Option(
    None,
    "--scheduler-opt",
    help="An option of the scheduler, KEY=VALUE (repeatable), e.g. address=HEAD:6379 for ray; "
    "`areal doctor check --scheduler NAME` lists them.",
)
# Flags kept for options a scheduler declares (Scheduler.runopts names its flag): Slurm's.
PartitionOpt = typer.Option(None, "--partition", help="Slurm partition (default: the cluster's).")
AccountOpt = typer.Option(None, "--account", help="Slurm account to charge.")
TimeOpt = typer.Option(None, "--time", help="Slurm time limit, e.g. 4:00:00.")
GpusPerNodeOpt = typer.Option(
    None, "--gpus-per-node", min=1, help="GPUs used per node (default: the partition's)."
)
SlurmArgOpt = typer.Option(
    None, "--slurm-arg", help="Passed to sbatch as is, e.g. --slurm-arg=--mem=64G. Repeatable."
)
SLURM_KEYS = {
    "partition": "str", "account": "str", "time": "str", "gpus_per_node": "posint",
    "slurm_arg": "list", "scheduler_opts": "mapping",
}  # fmt: skip

COLORS = [
    "cyan",
    "magenta",
    "green",
    "yellow",
    "blue",
    "bright_red",
    "bright_cyan",
    "bright_magenta",
]


NAME_MAX = 100  # names become directory names and registry keys; 255 bytes is the file limit


def check_name(kind: str, value: str) -> str:
    """Experiment and trial names: ASCII letters, digits, '-', '_', '.', not starting with
    '-' (it would read as an option) or '.' (hidden, and '..'), at most NAME_MAX long."""
    import re

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


# A job YAML is a few hundred bytes; even libyaml takes about a second per megabyte.
CONFIG_MAX_BYTES = 256 << 10


def load_config(path: Path | None, schema: dict[str, str]) -> dict[str, Any]:
    """A job YAML whose keys are the command's long flags (dashes or underscores).

    `schema` maps each key to its kind: str, int, posint, port, float, bool or list. Values
    are checked here, so a bad one is a usage error naming the key, never a traceback later.
    Files over CONFIG_MAX_BYTES are refused before parsing: a job YAML is never that big, and
    parsing one takes seconds per megabyte.
    """
    if path is None:
        return {}
    import yaml

    if not path.exists():
        raise UsageError(f"config file {path} does not exist")
    if not path.is_file():
        raise UsageError(f"config file {path} is not a regular file")
    try:
        with open(path, "rb") as f:
            raw = f.read(CONFIG_MAX_BYTES + 1)
    except OSError as e:
        raise UsageError(f"cannot read config file {path}: {e.strerror or e}") from None
    if len(raw) > CONFIG_MAX_BYTES:
        raise UsageError(
            f"config file {path} is larger than {CONFIG_MAX_BYTES >> 10} KiB",
            hint="a job YAML holds flags (a few lines); keep data in files it names",
        )
    # libyaml when PyYAML has it: several times faster, and it refuses nesting deeper than
    # 1000 levels itself (the pure-Python composer recurses into a RecursionError).
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        data = yaml.load(raw, Loader=loader) or {}
    except (yaml.YAMLError, RecursionError) as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark else None
        if isinstance(e, RecursionError) or "nesting depth" in str(e):
            key = _top_key(raw, line)
            where = (f" under key {key!r}" if key else "") + (f" (line {line})" if line else "")
            raise UsageError(
                f"config file {path} nests lists or mappings too deeply to read{where}",
                hint="a job YAML maps flags to plain values or flat lists",
            ) from None
        where = f" (line {line})" if line else ""
        raise UsageError(f"config file {path} is not valid YAML{where}") from None
    if not isinstance(data, dict):
        raise UsageError(f"config file {path} must hold a mapping of flag: value")
    out = {}
    for k, v in data.items():
        key = str(k).replace("-", "_")
        if key not in schema:
            raise UsageError(
                f"config file {path}: unknown key {_short_repr(k)}",
                hint="known keys: " + ", ".join(sorted(schema)),
            )
        if v is not None:
            out[key] = _convert(path, key, v, schema[key])
    return out


def _convert(path: Path, key: str, v: Any, kind: str) -> Any:
    def bad() -> UsageError:
        want = {
            "posint": "an integer >= 1", "port": "a port (1-65535)", "list": "a list",
            "posfloat": "a number > 0", "nonneg": "a number >= 0",
            "mapping": "a mapping of option: value",
        }  # fmt: skip
        return UsageError(
            f"config file {path}: {key} is {_short_repr(v)}, not {want.get(kind, 'a ' + kind)}"
        )

    if kind == "list":
        if not isinstance(v, list) or any(isinstance(x, (dict, list)) for x in v):
            raise bad()
        return [str(x) for x in v]
    if kind == "mapping":  # flat: a key to a plain value or a flat list
        if not isinstance(v, dict) or any(
            isinstance(x, dict)
            or (isinstance(x, list) and any(isinstance(y, (dict, list)) for y in x))
            for x in v.values()
        ):
            raise bad()
        return {str(k).replace("-", "_"): x for k, x in v.items()}
    if kind == "bool":
        if not isinstance(v, bool):
            raise bad()
        return v
    if kind == "str":
        if isinstance(v, (dict, list, bool)):
            raise bad()
        return str(v)
    if isinstance(v, bool):
        raise bad()
    if isinstance(v, (dict, list, set, tuple, bytes)):
        raise bad()
    try:
        num = float(v) if kind in ("float", "posfloat", "nonneg") else int(str(v))
    except (ValueError, TypeError, OverflowError):
        raise bad() from None
    import math

    if isinstance(num, float) and not math.isfinite(num):
        raise bad()
    if (kind == "posint" and num < 1) or (kind == "port" and not 0 < num < 65536):
        raise bad()
    if (kind == "posfloat" and num <= 0) or (kind == "nonneg" and num < 0):
        raise bad()
    return num


def _top_key(raw: bytes, line: int | None) -> str | None:
    """The top-level key whose value holds `line` (the last unindented `key:` at or above
    it); without a line, the first such key."""
    import re

    key = None
    for n, text in enumerate(raw.splitlines(), 1):
        if line is not None and n > line:
            break
        m = re.match(rb"([^\s#:\-?][^:]*?):(\s|$)", text)
        if m:
            key = m.group(1).decode(errors="replace").strip("'\"")
            if line is None:
                break
    return key


def _short_repr(v: Any) -> str:
    """A value as the user wrote it, cut short: a value may be a huge or self-referencing
    structure (YAML anchors), whose full repr would be the problem again."""
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxdict, r.maxstring, r.maxother = 3, 4, 4, 60, 60
    return r.repr(v)


def job_names(experiment, trial, config: dict) -> tuple[str, str]:
    return (
        check_name(
            "experiment", pick(experiment, config, "experiment", settings.DEFAULT_EXPERIMENT)
        ),
        check_name("trial", pick(trial, config, "trial", settings.DEFAULT_TRIAL)),
    )


def seconds(flag: str, value) -> float:
    """A duration from a flag or the config: finite and positive (`nan` and `inf` parse as
    floats and slip through a range check)."""
    import math

    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"{flag} {value:g} is not a number of seconds >= 0")
    return value


def pick(flag_value, config: dict, key: str, default):
    """Flags beat the config file, which beats the default."""
    if flag_value is not None:
        return flag_value
    return config.get(key, default)


class LinePrinter:
    """Prints process output with a stable coloured [label] prefix per process."""

    def __init__(self, console):
        self.console = console
        self.colors: dict[str, str] = {}

    def __call__(self, label: str, line: str) -> None:
        from rich.markup import escape

        color = self.colors.setdefault(label, COLORS[len(self.colors) % len(COLORS)])
        self.console.print(f"[{color}]\\[{label}][/] {escape(line)}")


def show_plan(request, json_out: bool) -> None:
    """--dry-run: the request as JSON, or as a newcomer reads it: one block per process,
    argv copy-pasteable (and the batch script a cluster scheduler would submit). The API key
    is never shown."""
    import shlex

    from rich.markup import escape

    from areal_cli import console as _console

    if json_out:
        _console.print_json(request.to_json())
        return
    console = _console.out
    plan = request.plan

    console.print(
        f"[bold]plan[/] {plan.experiment}/{plan.trial} ({plan.kind})\n"
        f"  logs      {plan.log_dir}\n  registry  {plan.registry}\n"
        f"  api key   {'set (not shown)' if plan.api_key else 'none'}"
    )
    data = plan.to_json()
    for p in data["processes"]:
        addr = f"  http://{p['host']}:{p['port']}" if p.get("port") else ""
        cores = ",".join(map(str, p.get("cpus") or ()))
        gpus_ = ",".join(map(str, p["gpus"])) or (f"none (CPU cores {cores})" if cores else "cpu")
        label = "torchrun" if p["role"] == "trainer" else f"{p['role']}-{p['index']}"
        where = data.get("placement", {}).get(label)  # where a cluster scheduler puts it
        console.print(f"[bold cyan]{label}[/]{addr}  " + (where or f"GPUs {gpus_}"))
        console.print(f"  argv  {escape(shlex.join(p['argv']))}")
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(p["env"].items()))
        console.print(f"  env   {escape(env)}")
        console.print(f"  log   {p['log_path']}")
    for note in plan.notes:
        console.print(f"[yellow]note[/] {escape(note)}")
    script = getattr(plan, "script", None)
    if script:
        console.print(f"[bold cyan]{request.scheduler} batch script[/]")
        console.print(escape(script), highlight=False)


def scheduler_opts(
    sched,
    config: dict,
    partition,
    account,
    time,
    gpus_per_node,
    slurm_arg,
    scheduler_opt=None,
):
    """The options of `sched` (the one scheduler_for chose), from its flags, `--scheduler-opt
    KEY=VALUE`, and the job YAML (`scheduler_opts:` or a flag's key), checked against what
    the scheduler declares (Scheduler.runopts): one it does not take is a usage error naming
    those it does."""
    from areal_cli import schedulers
    from areal_cli.spec import SchedulerOpts

    chosen = sched.name
    declared = {o.name: o for o in sched.runopts}
    flags = {"partition": partition, "account": account, "time": time,
             "gpus_per_node": gpus_per_node, "slurm_arg": slurm_arg or None}  # fmt: skip
    given: dict[str, tuple[str, Any]] = {}
    for key in flags:
        if config.get(key) not in (None, []):
            given[key] = (f"{key} in the job YAML", config[key])
    for key, value in (config.get("scheduler_opts") or {}).items():
        given[key] = (f"scheduler_opts.{key} in the job YAML", value)
    for item in scheduler_opt or ():
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
    for key, value in flags.items():
        if value not in (None, []):
            given[key] = (f"--{key.replace('_', '-')}", value)
    values = {}
    for key, (where, value) in given.items():
        opt = declared.get(key)
        if opt is None:
            known = ", ".join(f"{o.name} ({o.help})" for o in declared.values()) or "none"
            owners = [n for n in schedulers.names() if n != chosen and _declares(n, key)]
            also = (
                f"it is an option of {' and '.join(owners)}: add --scheduler {owners[0]} (or "
                f"scheduler: {owners[0]} in the job YAML); "
                if owners
                else ""
            )
            raise UsageError(
                f"{where}: not an option of the {chosen} scheduler",
                hint=f"{also}the {chosen} scheduler takes: {known}",
            )
        values[key] = _runopt_value(opt, value, where)
    return SchedulerOpts(tuple(sorted(values.items())))


def _declares(name: str, key: str) -> bool:
    from areal_cli import schedulers

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


def scheduler_for(name: str | None, config: dict, home, registry):
    """The scheduler a command runs on: --scheduler, the job YAML, AREAL_SCHEDULER, local."""
    from areal_cli import schedulers

    return schedulers.get(
        schedulers.pick(name, config), home=settings.home(home), registry=registry
    )


def _note_used(request) -> None:
    """So that `areal ps` asks this scheduler about this home (schedulers.USED)."""
    from areal_cli import schedulers

    schedulers.note_used(settings.home(request.plan.home or None), request.scheduler)


def run_foreground(sched, request, json_out: bool = False) -> None:
    """Run the job in this process's foreground: prefixed logs and events on stderr, Ctrl-C
    or SIGTERM tears it down. Exits with the job's code (130/143 when stopped)."""
    from areal_cli import console
    from areal_cli.schedulers.api import Stopped

    plan = request.plan
    err = console.err
    name = f"{plan.experiment}/{plan.trial}"

    def on_event(kind: str, info: dict) -> None:
        if kind == "healthy":
            node = f" (node {info['node']})" if info.get("node") else ""
            err.print(f"[green]healthy[/] {info['label']} at http://{info['addr']}{node}")
        elif kind == "running":
            nodes = ",".join(info["nodes"])
            err.print(f"[green]running[/] {sched.label} job {info['job_id']} on {nodes}")
        elif kind == "ready" and not plan.trainers:
            n = len(info["servers"])
            err.print(f"[bold green]ready[/] {name}: {n} server(s) registered; Ctrl-C stops them")
            if json_out:
                console.print_json({"experiment": plan.experiment, "trial": plan.trial,
                                    "servers": info["servers"]})  # fmt: skip
        elif kind == "spawned" and info["label"] == "torchrun":
            err.print(f"[green]started[/] torchrun (pid {info['pid']})")
        elif kind == "submitted":
            err.print(f"[green]submitted[/] {info['what']}")
        elif kind == "server_lost":
            err.print(f"[red]lost[/] {info['label']} ({info['why']}); deregistered")
        elif kind == "trainer_exit":
            color = "green" if info["code"] == 0 else "red"
            err.print(f"[{color}]training finished[/] with exit code {info['code']}")
        elif kind == "stopping":
            why = "" if info["state"] == "stopped" else f" ({info['state']})"
            err.print(f"[yellow]stopping[/] {name}{why}")
        elif kind == "restart":  # a restart of the trainers, or a refusal (diagnose.restart)
            from rich.markup import escape

            err.print(f"[{'yellow' if info['restart'] else 'red'}]{escape(info['line'])}[/]")
        elif kind == "resumed":
            left = ", ".join(info["servers"])
            err.print(f"[yellow]resumed[/] {left} (left paused by the trainer)")

    def handler(signum, _frame):
        sched.request_stop(signum)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    _note_used(request)
    try:
        sched.schedule(request, detach=False, on_event=on_event, on_line=LinePrinter(err))
    except Stopped as e:
        raise typer.Exit(e.code) from None
    raise typer.Exit(0)


def run_detached(sched, request, json_out: bool) -> None:
    """Start the job in the background and return once it is ready; print where it runs."""
    from areal_cli import console
    from areal_cli.schedulers.api import Stopped

    plan = request.plan
    n = len(plan.servers)
    what = f"{n} server(s)" if n else "the job"
    with console.err.status(f"starting {what} for {plan.experiment}/{plan.trial} ...") as status:

        def progress(text: str) -> None:
            status.update(f"{plan.experiment}/{plan.trial}: {text}")

        _note_used(request)
        try:
            handle = sched.schedule(request, detach=True, on_progress=progress)
        except KeyboardInterrupt:
            console.err.print(
                f"[yellow]interrupted[/]: stopped the starting job {plan.experiment}/{plan.trial}"
            )
            raise typer.Exit(130) from None
        except Stopped as e:
            # `areal stop` from elsewhere ended the job before it was ready: not a failure.
            console.err.print(
                f"[yellow]stopped[/] {plan.experiment}/{plan.trial} before it was ready "
                f"(areal stop); nothing of it is left"
            )
            raise typer.Exit(e.code) from None
    job = sched.describe_ready(handle)
    servers = [
        {"addr": s.addr, "pid": s.pid, "gpus": s.gpus, "node": s.node,
         "log": f"{job.log_dir}/server-{i}.log"}
        for i, s in enumerate(job.servers)
    ]  # fmt: skip
    if json_out:
        console.print_json({**job.to_json(), "servers": servers})
        return
    where = f" ({sched.label} job {handle.job_id})" if handle.job_id else ""
    if plan.trainers:
        # Training runs on in the background: say how to follow, diagnose and end it.
        with_servers = f" with {len(servers)} server(s)" if servers else ""
        console.out.print(f"[green]started[/] {handle.name}{where}: training{with_servers}")
        console.out.print(f"follow with: areal logs {handle.name} -f")
        console.out.print(f"if it hangs: areal doctor hang --job {handle.name}")
    else:
        console.out.print(
            f"[green]ready[/] {handle.name}{where}: {len(servers)} server(s) healthy and registered"
        )
    for s in servers:
        node = f"  node {s['node']}" if handle.job_id and s["node"] else ""
        console.out.print(
            f"  http://{s['addr']}  pid {s['pid']}  gpus {s['gpus'] or 'cpu'}{node}  log {s['log']}"
        )
    console.out.print(f"stop with: areal stop {handle.name}")


def python_default() -> str:
    import sys

    return os.environ.get("AREAL_PYTHON") or sys.executable
