"""Pieces every command shares: name options, config files, log prefixes, plan rendering."""

from __future__ import annotations

import functools
import inspect
import signal
from pathlib import Path
from typing import Any

import typer

from areal_cli import console, schedulers, settings
from areal_cli.errors import UsageError
from areal_cli.schedulers.api import Stopped
from areal_cli.spec import Asked

# No default of their own: `serve` and `train` name the job (jobspec.job_names), where
# other commands take no name as "every job".
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
    "a KEY it does not take is refused with the list of those it does.",
)
# A job YAML (--config) sets the options of `serve` and `train`: its keys are their long
# flags, except these, which say how to run this invocation rather than what the job is.
NOT_IN_YAML = frozenset(
    {"config", "home", "registry", "detach", "dry_run", "json_out", "scheduler_opt"}
)
# Keys without a flag: `--scheduler-opt K=V` is a mapping in YAML, and serve's arguments for
# the backend (after --) are a list.
YAML_ONLY = {"scheduler_opts": "mapping", "extra_args": "list"}
_CONFIG = "areal.job_yaml"  # ctx.meta: the job YAML as read


def _read_config(ctx: typer.Context, value: Path | None) -> Path | None:
    """--config FILE: read before any other option (eager), its values become the command's
    defaults (click's default_map), so a flag beats the file and the file the default."""
    if value is None:
        return value
    schema = config_keys(ctx.command)
    params = {p.name: p for p in ctx.command.params if p.name in schema}
    data = load_config(value, schema)
    for key, v in data.items():
        if key in params:
            _check_value(ctx, value, key, v, params[key])
    ctx.meta[_CONFIG] = data
    ctx.default_map = {**(ctx.default_map or {}), **{k: v for k, v in data.items() if k in params}}
    return value


ConfigOpt = typer.Option(
    None,
    "--config",
    "-c",
    is_eager=True,
    callback=_read_config,
    help="Job YAML; keys are these flags.",
)


# The options of `serve` and `train` alike (job_command adds them): what the job is named,
# where it runs (the flags of the schedulers' run options come after --scheduler), how this
# invocation reads and prints.
_JOB_OPTIONS = (
    ("experiment", str, ExperimentOpt),
    ("trial", str, TrialOpt),
    ("registry", str, RegistryOpt),
    ("home", Path, HomeOpt),
    ("config", Path, ConfigOpt),
    ("scheduler", str, SchedulerOpt),
)
_LAST_OPTIONS = (
    ("scheduler_opt", list[str], SchedulerOptOpt),
    ("json_out", bool, JsonOpt),
)
_RUNOPT_TYPES = {"str": str, "posint": int, "list": list[str]}


def runopt_options() -> list[tuple[str, type, Any]]:
    """An option of `serve` and `train` for each flag of the installed schedulers' run
    options (RunOpt.flag): its kind, help and default are the scheduler's."""
    out = []
    for o in schedulers.flagged_runopts():
        text = o.help[:1].upper() + o.help[1:] + "."
        if o.kind == "list":
            text += " Repeatable."
        extra = {"min": 1} if o.kind == "posint" else {}
        option = typer.Option(o.default, o.flag, help=text, **extra)
        out.append((o.name, _RUNOPT_TYPES[o.kind], option))
    return out


def config_keys(command) -> dict[str, str]:
    """The keys a job YAML of `command` takes and the kind of each (see load_config), read
    off the command's own options: one schema for the flags, the file and the defaults."""
    keys = {
        p.name: _kind(p)
        for p in command.params
        if p.param_type_name == "option" and p.name not in NOT_IN_YAML
    }
    keys["scheduler_opts"] = YAML_ONLY["scheduler_opts"]
    # Extra arguments are a list key where they are the command's own (serve's, for the
    # backend); after an argument (train's SCRIPT) they are that argument's.
    extra = (command.context_settings or {}).get("allow_extra_args", command.allow_extra_args)
    if extra and not any(p.param_type_name == "argument" for p in command.params):
        keys["extra_args"] = YAML_ONLY["extra_args"]
    return keys


def yaml_keys(command: str) -> dict[str, str]:
    """config_keys of `command` ("serve", "train") as the CLI builds it."""
    from areal_cli._app import _load  # the CLI's builder: it imports this module

    return config_keys(_load(command))


def _kind(param) -> str:
    """A click option's kind as load_config checks it, by its type (typer's click types are
    its own copy, so by their names)."""
    if param.multiple:
        return "list"
    name = str(getattr(param.type, "name", ""))
    low, high = getattr(param.type, "min", None), getattr(param.type, "max", None)
    if name == "boolean" or param.is_flag:
        return "bool"
    if name.split()[0] in ("int", "integer"):
        if (low, high) == (1, 65535):
            return "port"
        return "posint" if low == 1 else "int"
    if name.startswith("float"):
        if low is None:
            return "float"
        return "posfloat" if low > 0 else "nonneg"
    return "str"


def _check_value(ctx, path: Path, key: str, value, param) -> None:
    """A value load_config took that the option's own type refuses (its range): the message
    names the file and key, as one from load_config does."""
    try:
        param.type_cast_value(ctx, value)
    except typer.BadParameter as e:
        raise UsageError(
            f"config file {path}: {key} is {_short_repr(value)}: {e.message}"
        ) from None


def job_command(func):
    """`func` (serve or train) as a command: the options every job command takes appended
    to its signature, where typer reads a command's options; declared once, here, with the
    flags of the schedulers installed now (runopt_options). `func` takes them as keyword
    arguments and reads every option through asked(ctx)."""
    own = [
        p
        for p in inspect.signature(func, eval_str=True).parameters.values()
        if p.kind is not p.VAR_KEYWORD
    ]
    flags = runopt_options()
    _check_free(func.__name__, own, flags)
    shared = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=kind)
        for name, kind, opt in (*_JOB_OPTIONS, *flags, *_LAST_OPTIONS)
    ]

    @functools.wraps(func)
    def command(*args, **kwargs):
        return func(*args, **kwargs)

    command.__signature__ = inspect.Signature(own + shared)
    return command


def _check_free(command: str, own: list, flags: list) -> None:
    """A scheduler's flag must not be an option `command` has already (a plug-in's
    --model): one of the two would never see its value."""
    options = [(p.name, p.default) for p in own]
    options += [(name, opt) for name, _, opt in (*_JOB_OPTIONS, *_LAST_OPTIONS)]
    taken = {n for name, opt in options for n in (name, *(getattr(opt, "param_decls", None) or ()))}
    for name, _, option in flags:
        (flag,) = option.param_decls
        if name in taken or flag in taken:
            raise UsageError(
                f"a scheduler's run option {name} ({flag}) is an option of `{command}` already",
                hint="a scheduler plug-in's flags must be its own: rename it",
            )


def asked(ctx: typer.Context) -> Asked:
    """What the user asked of the command being run, flags and job YAML merged by click."""
    flags = {n for n in ctx.params if ctx.get_parameter_source(n).name == "COMMANDLINE"}
    return Asked(dict(ctx.params), frozenset(flags), ctx.meta.get(_CONFIG, {}))


def launch(sched, spec, asked: Asked, notes=(), told=()) -> None:
    """The last steps of `serve` and `train`: the scheduler's request (its plan, `notes`
    first); --dry-run shows it, else the job runs detached or in the foreground, `told`
    printed first (notes a run shows too)."""
    request = sched.dryrun(spec, check_packages=not asked["dry_run"])
    request.plan.notes[:0] = notes
    if asked["dry_run"]:
        show_plan(request, asked["json_out"])
        return
    for note in told:
        console.err.print(f"[yellow]note[/] {note}")
    if asked["detach"]:
        run_detached(sched, request, asked["json_out"])
    else:
        run_foreground(sched, request, asked["json_out"])


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

    if json_out:
        console.print_json(request.to_json())
        return
    out = console.out
    plan = request.plan

    out.print(
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
        out.print(f"[bold cyan]{label}[/]{addr}  " + (where or f"GPUs {gpus_}"))
        out.print(f"  argv  {escape(shlex.join(p['argv']))}")
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(p["env"].items()))
        out.print(f"  env   {escape(env)}")
        out.print(f"  log   {p['log_path']}")
    for note in plan.notes:
        out.print(f"[yellow]note[/] {escape(note)}")
    script = getattr(plan, "script", None)
    if script:
        out.print(f"[bold cyan]{request.scheduler} batch script[/]")
        out.print(escape(script), highlight=False)


def scheduler_for(asked: Asked):
    """The scheduler a command runs on: --scheduler, the job YAML, AREAL_SCHEDULER, local."""
    return schedulers.get(
        schedulers.pick(asked["scheduler"]),
        home=settings.home(asked["home"]),
        registry=asked["registry"],
    )


def _note_used(request) -> None:
    """So that `areal ps` asks this scheduler about this home (schedulers.USED)."""
    schedulers.note_used(settings.home(request.plan.home or None), request.scheduler)


def run_foreground(sched, request, json_out: bool = False) -> None:
    """Run the job in this process's foreground: prefixed logs and events on stderr, Ctrl-C
    or SIGTERM tears it down. Exits with the job's code (130/143 when stopped)."""
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
