"""What every scheduler needs the same way: job markers, API keys, what training workers find in
their environment, AReaL's overrides, and reading a failure out of the logs (root cause first).

Schedulers differ in where processes run (this host, Slurm job steps), not in what a worker
sees or how a failure is told, so those live here once.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import uuid
from pathlib import Path

from areal_cli import areal_entry, backends, control, logfiles, settings
from areal_cli.areal_entry import SPMD_ENV
from areal_cli.launchers import torchrun
from areal_cli.parallel import MESH_ENV
from areal_cli.registry import Registry, open_registry
from areal_cli.spec import JobSpec, Plan, TrainerRole

MARKER_PREFIX = "areal"
TAIL_LINES = 20


def new_marker(experiment: str, trial: str) -> str:
    """What every process of one job carries in AREAL_JOB_MARKER (and its registry entries)."""
    return f"{MARKER_PREFIX}-{experiment}-{trial}-{uuid.uuid4().hex[:8]}"


def plan_fields(spec: JobSpec, home: Path, registry: Registry) -> dict:
    """What every plan of `spec` holds, whichever scheduler runs it (`registry`: opened)."""
    return dict(
        experiment=spec.experiment, trial=spec.trial, kind=spec.kind,
        log_dir=str(settings.log_dir(home, spec.experiment, spec.trial)), home=str(home),
        registry=registry.url, marker=new_marker(spec.experiment, spec.trial), alloc=spec.alloc,
        health_timeout=spec.health_timeout, registry_ttl=settings.registry_ttl(),
        server_restarts=spec.servers.max_restarts if spec.servers else 0,
        # The trainers' watchdog and restarts (off for a job without trainers).
        watchdog=spec.watchdog if spec.trainer else 0.0, watchdog_action=spec.watchdog_action,
        watchdog_auto=spec.watchdog_auto, restart_on=spec.restart_on,
        max_restarts=spec.max_restarts if spec.trainer else 0,
    )  # fmt: skip


def resolve_api_key(flag: str) -> str | None:
    """`auto`: a generated key, wherever the servers bind (every local user reaches
    127.0.0.1, and could pause the servers or load other weights); `none`: no key; else the
    key."""
    if flag == "none":
        return None
    if flag == "auto":
        # SGLang reads its key back as a command-line value (sglang_launch): one that starts
        # with "-" is taken for a flag ("--api-key: expected one argument").
        while (key := secrets.token_urlsafe(24)).startswith("-"):
            pass
        return key
    return flag


# Collectives torch's flight recorder keeps per rank: a 2-rank gloo all_reduce loop costs no
# measurable time with it (docs/doctor.md, "The flight recorder"); a few MB of host memory.
FR_BUFFER_SIZE = 2000
FR_BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def worker_env(
    spec: JobSpec, t: TrainerRole, p: Plan, addrs, backend, key, visible: str | None
) -> dict[str, str]:
    """What each training worker finds in its environment (and what AReaL's launcher sets).
    `visible`: CUDA_VISIBLE_DEVICES, or None where the scheduler binds GPUs itself (Slurm)."""
    env = {
        "AREAL_LLM_SERVER_ADDRS": ",".join(addrs),
        "AREAL_SERVER_BACKEND": backend or "",
        "AREAL_REGISTRY": p.registry,
        "AREAL_EXPERIMENT": spec.experiment,
        "AREAL_TRIAL": spec.trial,
        "AREAL_ALLOC": t.alloc,
        MESH_ENV: spec.train_dims().to_env(),
        "AREAL_LOG_DIR": p.log_dir,
        # Where the workers find the servers' API key when they discover servers themselves.
        "AREAL_HOME": p.home,
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        # Global ranks in torchrun's line prefix, so per-rank logs are right on every node.
        **torchrun.LINE_PREFIX_ENV,
    }
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
        env["OMP_NUM_THREADS"] = os.environ.get(
            "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, t.nproc)))
        )
    # What the engine needs of ranks that talk to it (SGLang: NCCL settings of its own).
    engine = backends.find(backend)
    if engine is not None:
        env.update(engine.trainer_env())
    if key:
        env["AREAL_API_KEY"] = key
    if t.areal_overrides:
        env.update(SPMD_ENV)
    # torch's flight recorder on (the doctor joins it with the stacks). torch 2.13 reads
    # TORCH_FR_BUFFER_SIZE first and warns on every rank that the older name is deprecated, so
    # only the new name is set; the user's own setting of either, 0 included, wins, and a
    # --debug-preset after it.
    if not any(os.environ.get(name) for name in FR_BUFFER_VARS):
        env[FR_BUFFER_VARS[0]] = str(FR_BUFFER_SIZE)
    env.update(dict(t.env))
    return env


def external_servers(p: Plan, spec: JobSpec) -> tuple[list[str], str, str | None]:
    """The servers a training-only job uses (found or given before the plan): their
    addresses, backend and the API key they want (the plan holds it only to redact it)."""
    p.api_key = spec.external_api_key
    return list(spec.external_servers), spec.external_backend or backends.FALLBACK, p.api_key


def script_args(spec: JobSpec, backend: str, n_servers: int, registry) -> list[str]:
    """The training script's arguments, AReaL's overrides after them when asked for."""
    args = list(spec.trainer.script_args)
    if spec.trainer.areal_overrides:
        args += areal_overrides(spec, backend, n_servers, registry)
    return args


def areal_overrides(spec: JobSpec, backend: str, n_servers: int, registry) -> list[str]:
    """AReaL's config overrides (areal_entry.overrides) that point its trainer at the
    servers found and at our registry, where its name_resolve finds them under the same
    experiment/trial, in the form the trainer's AReaL version understands."""
    t = spec.trainer
    return areal_entry.overrides(
        t.areal_version, backend, n_servers, t.alloc if t else "", spec.experiment, spec.trial,
        registry.areal_name_resolve(),
    )  # fmt: skip


# -- failures, root cause first ------------------------------------------------------------


def resume_left_paused(plan: Plan, timeout: float = 3.0) -> list[str]:
    """A trainer stopped mid-sync leaves the servers it used paused, and those outlive it
    when another job started them: once its ranks are gone, resume the ones that are paused.
    Returns the servers resumed."""
    ours = {p.addr for p in plan.servers}  # stopped with this job anyway
    resumed: list[str] = []
    for t in plan.trainers:
        addrs = [a for a in t.env.get("AREAL_LLM_SERVER_ADDRS", "").split(",") if a]
        addrs = [a for a in addrs if a not in ours]
        if addrs:
            backend = t.env.get("AREAL_SERVER_BACKEND") or backends.FALLBACK
            resumed += control.resume_paused(addrs, backend, t.env.get("AREAL_API_KEY"), timeout)
    return resumed


def describe_exit(code: int) -> str:
    if code < 0:
        code = 128 - code
    if code > 128:
        try:
            return f"killed by {signal.Signals(code - 128).name}"
        except ValueError:
            pass
    return f"exit code {code}"


def tail_text(path: str | Path) -> str:
    """The last lines of a process's log, without the replica runner's own lines."""
    lines = [x for x in logfiles.tail(path, TAIL_LINES + 10) if not x.startswith("[replica]")]
    return "\n".join(lines[-TAIL_LINES:]) or "(no output)"


def explain_failure(
    log_dir: Path, torchrun_logs: list[str | Path]
) -> tuple[int | None, int | None, str | None, str | None, str | None]:
    """(first failing rank, its exit code, what it died of, a hint, its node) for a training
    job's failure report: the same verdict as `areal doctor why` (every rank's and every
    node's log, peers' consequences set aside)."""
    from areal_cli.diagnose import why  # the log parser: only once a training job failed

    rank, code, rep = why.first_failure(log_dir, torchrun_logs, kernel=why.read_kernel())
    if rank is None:
        rank, code = root_cause(log_dir, torchrun_logs)
    root = rep.root
    return rank, code, rep.headline(), root.hint if root else None, root.node if root else None


def root_cause(log_dir: Path, torchrun_logs: list[str | Path]) -> tuple[int | None, int | None]:
    """(first failing rank, its exit code) from torchrun's failure report: "rank : 1
    (local_rank: 1)" then "exitcode : 5 (pid: 123)". Several nodes: the first report that names
    a rank. Without one, the lowest rank whose log shows an error."""
    for log in torchrun_logs:
        text = "\n".join(logfiles.tail(log, 60))
        head = max(text.rfind("Root Cause"), 0)
        m = re.search(r"\brank\s*:\s*(\d+)", text[head:])
        if m:
            code = re.search(r"exitcode\s*:\s*(-?\d+)", text[head + m.end() :])
            return int(m.group(1)), (int(code.group(1)) if code else None)
    failing = []
    for label, path in logfiles.select_logs(Path(log_dir), "rank").items():
        if any("Error" in x or "Traceback" in x for x in logfiles.tail(path, TAIL_LINES)):
            failing.append(int(label.split("-")[1]))
    return (min(failing) if failing else None), None


def opened(registry: Registry | str | None) -> Registry:
    """A planner's registry: the object the command opened, or one opened here from a URL."""
    if registry is None or isinstance(registry, (str, Path)):
        return open_registry(registry)
    return registry
