"""What every scheduler offers, in the shape of TorchX's scheduler API:

    request = scheduler.dryrun(spec)            # what --dry-run prints; starts nothing
    handle  = scheduler.schedule(request, ...)  # start it (foreground or detached)
    scheduler.describe(handle)                  # one job's status
    scheduler.list()                            # every job this scheduler knows
    scheduler.log_iter(handle, role, index, follow)
    scheduler.cancel(handle)

A job is named by its experiment/trial and kind (a trial holds one serving and one training
job). Commands talk to this interface only; each scheduler keeps its own records.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator

from areal_cli import logfiles
from areal_cli.errors import UsageError
from areal_cli.plain import Frozen, Plain, plain

# typing's TYPE_CHECKING without importing typing (5 ms of `areal ps`): type checkers take the
# name as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from pathlib import Path
    from typing import Any

    from areal_cli.spec import JobSpec

# Job states, the same words for every scheduler.
LIVE = ("pending", "starting", "running", "stopping")
ENDED = ("stopped", "failed", "killed", "cancelled", "dead")

EventFn = Callable[[str, dict], None]  # ("healthy", {...}), ("ready", ...), ...
LineFn = Callable[[str, str], None]  # (label, line): "server-0", "rank-1", ...


def parse_name(name: str) -> tuple[str, str]:
    """'E/T' → (E, T); bad spellings are usage errors."""
    parts = name.strip("/").split("/")
    if len(parts) != 2 or not all(parts):
        raise UsageError(
            f"job name {name!r} is not EXPERIMENT/TRIAL",
            hint="for example: areal stop default/trial0 (see `areal ps`)",
        )
    return parts[0], parts[1]


class Handle(Frozen):
    """One job, named by its E/T and kind."""

    __slots__ = ("scheduler", "experiment", "trial", "kind", "job_id")

    def __init__(
        self,
        scheduler: str,
        experiment: str,
        trial: str,
        kind: str,  # "serve" | "train" | "serve+train"
        job_id: str | None = None,  # the scheduler's own id (a Slurm job id)
    ):
        self._freeze(scheduler, experiment, trial, kind, job_id)

    @property
    def name(self) -> str:
        return f"{self.experiment}/{self.trial}"

    def __str__(self) -> str:
        return f"{self.scheduler}://{self.name}/{self.kind}" + (
            f"#{self.job_id}" if self.job_id else ""
        )


class RunOpt(Frozen):
    """One option a scheduler declares for itself (TorchX's runopts): set with
    `--scheduler-opt NAME=VALUE`, in a job YAML's `scheduler_opts:` mapping (or its own key
    there where it has a flag), or by its `flag`: a flag of `serve` and `train` for every
    installed scheduler that names one (Slurm's --partition). `kind`: one of KINDS (a list
    flag is repeatable). `default`: its value when not set (a tuple for a list)."""

    __slots__ = ("name", "kind", "help", "flag", "default")
    KINDS = ("str", "posint", "list")

    def __init__(
        self, name: str, kind: str, help: str, flag: str | None = None, default: Any = None
    ):
        # Checked here, where the scheduler's module declares it: a wrong kind is an error
        # loading that scheduler, not a surprise when its flag is built or read.
        if kind not in self.KINDS:
            raise ValueError(f"run option {name!r}: kind {kind!r} is not one of {self.KINDS}")
        if flag is not None and not flag.startswith("--"):
            raise ValueError(f"run option {name!r}: flag {flag!r} does not start with --")
        self._freeze(name, kind, help, flag, default)


class Request(Plain):
    """A job ready to start: what `--dry-run` shows. `plan` is the scheduler's own form
    (local: processes with argv, env, GPUs, ports; slurm: that plus the sbatch script)."""

    __slots__ = ("scheduler", "spec", "plan")

    def __init__(self, scheduler: str, spec: JobSpec, plan: Any):
        self.scheduler, self.spec, self.plan = scheduler, spec, plan

    def to_json(self) -> dict:
        out = self.plan.to_json() if hasattr(self.plan, "to_json") else dict(self.plan)
        return {"scheduler": self.scheduler, **out}


class ServerStatus(Plain):
    """One server of a job as `areal ps` shows it."""

    __slots__ = ("addr", "healthy", "pid", "gpus", "node", "paused", "exit_code", "errors",
                 "restarts")  # fmt: skip

    def __init__(
        self,
        addr: str,
        healthy: bool,
        pid: int | None = None,
        gpus: list[int] | None = None,
        node: str | None = None,
        paused: bool = False,
        exit_code: int | None = None,
        # Requests answered with errors in the last minute, and the last one (request_errors).
        errors: dict | None = None,
        restarts: int = 0,  # how often its runner started it again after it exited
    ):
        self.addr, self.healthy, self.pid, self.node = addr, healthy, pid, node
        self.gpus = [] if gpus is None else gpus
        self.paused, self.exit_code = paused, exit_code
        self.errors, self.restarts = errors, restarts


# What every scheduler's job record holds under the names JobStatus gives it.
RECORDED = ("log_dir", "alloc", "model", "message", "exit_code", "marker")


class JobStatus(Plain):
    """What `areal ps` shows of one job."""

    __slots__ = ("handle", "state", "host", "nodes", "pids", "servers", "started", "log_dir",
                 "alloc", "model", "message", "exit_code", "ranks_alive", "world_size", "reason",
                 "marker", "registry", "watchdog", "restarts")  # fmt: skip

    def __init__(
        self,
        handle: Handle,
        state: str,
        host: str | None = None,
        nodes: list[str] | None = None,
        pids: list[int] | None = None,
        servers: list[ServerStatus] | None = None,
        started: float = 0.0,
        log_dir: str | None = None,
        alloc: str | None = None,
        model: str | None = None,
        message: str | None = None,
        exit_code: int | None = None,
        ranks_alive: int | None = None,
        world_size: int | None = None,
        reason: str | None = None,  # why a queued job waits (Slurm's reason)
        marker: str | None = None,  # what every process of the job carries in AREAL_JOB_MARKER
        registry: str | None = None,  # where its servers and ranks are registered
        watchdog: dict | None = None,  # the last stall the watchdog diagnosed (its verdict, bundle)
        # Each restart of the trainers and each refusal, in order (diagnose.restart.Decision).
        restarts: list[dict] | None = None,
    ):
        self.handle, self.state, self.host, self.started = handle, state, host, started
        self.nodes = [] if nodes is None else nodes
        self.pids = [] if pids is None else pids
        self.servers = [] if servers is None else servers
        self.log_dir, self.alloc, self.model, self.message = log_dir, alloc, model, message
        self.exit_code, self.ranks_alive, self.world_size = exit_code, ranks_alive, world_size
        self.reason, self.marker, self.registry = reason, marker, registry
        self.watchdog = watchdog
        self.restarts = [] if restarts is None else restarts

    @classmethod
    def of_record(cls, handle: Handle, state: str, rec: Any, **fields: Any) -> JobStatus:
        """A job's status from its record, whatever its scheduler: what every job record
        holds under the same names (RECORDED), and `fields`."""
        return cls(handle, state, **{name: getattr(rec, name) for name in RECORDED}, **fields)

    def to_json(self) -> dict:
        d = plain(self)
        h = d.pop("handle")
        return {
            "name": self.handle.name,
            "experiment": h["experiment"],
            "trial": h["trial"],
            "kind": h["kind"],
            "scheduler": h["scheduler"],
            "job_id": h["job_id"],
            **d,
        }


class StopResult(Plain):
    """What `areal stop` did to one job."""

    __slots__ = ("name", "was_running", "killed", "deregistered", "cancelled", "left", "running")

    def __init__(
        self,
        name: str,
        was_running: bool,
        killed: int = 0,  # processes signalled, or Slurm jobs cancelled
        deregistered: int = 0,
        cancelled: str | None = None,  # the cluster job cancelled ("Slurm job 123")
        # What could not be stopped or removed, each in words (why, and what becomes of it).
        left: list[str] | None = None,
        # Something of the job still runs (a process that outlived SIGKILL): `areal stop` exits 3.
        running: bool = False,
    ):
        self.name, self.was_running, self.killed = name, was_running, killed
        self.deregistered, self.cancelled, self.running = deregistered, cancelled, running
        self.left = [] if left is None else left


class Stopped(Exception):
    """A foreground job that ended because it was stopped, not because something failed:
    its exit code is 130 (Ctrl-C) or 143 (SIGTERM, `areal stop`)."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class Scheduler(ABC):
    name: str
    label: str = ""  # how messages name one of its jobs: "Slurm" job 58, "Ray" job 6294eae8
    runopts: tuple[RunOpt, ...] = ()  # the options it takes (spec.scheduler_opts holds them)
    # Who `doctor why` names as the sender when a job record says only "killed": the one
    # way this scheduler itself kills a job (None: it never does).
    killed_by: str | None = None
    # The folder of its job records under AREAL_HOME (empty: its name).
    records: str = ""
    # Whether its jobs run on nodes the doctor reaches through run_on_nodes (a cluster's);
    # False: every process of its jobs runs on this host, where the doctor looks itself.
    reaches_nodes: bool = False
    # Seconds for a command to start on every node through run_on_nodes: the doctor names a
    # moment that far ahead for the nodes' first sample (or recording) to start together.
    node_start_s: float = 0.5

    @abstractmethod
    def dryrun(self, spec: JobSpec) -> Request: ...

    @abstractmethod
    def schedule(
        self,
        request: Request,
        *,
        detach: bool,
        on_event: EventFn | None = None,
        on_line: LineFn | None = None,
        on_progress: Callable[[str], None] | None = None,
    ) -> Handle:
        """Start the job. Foreground (`detach=False`): stream and supervise until it ends,
        raising its failure; Ctrl-C/SIGTERM stop it. Detached: return once it is ready."""

    @abstractmethod
    def describe(self, handle: Handle) -> JobStatus | None: ...

    def describe_ready(self, handle: Handle) -> JobStatus | None:
        """The job that `schedule(detach=True)` just returned as ready. Its servers were
        proven healthy a moment ago (a runner registers its server only then): a scheduler
        that can say so from its records, without asking each server again (SGLang's
        /health takes a second and more), does."""
        return self.describe(handle)

    @abstractmethod
    def list(self, include_ended: bool = False) -> list[JobStatus]: ...

    @abstractmethod
    def find(self, experiment: str, trial: str, kind: str | None = None) -> list[Handle]:
        """This scheduler's jobs of E/T (of `kind` if given), live ones first."""

    def log_iter(
        self,
        handle: Handle,
        role: str | None = None,
        index: int | None = None,
        follow: bool = False,
        lines: int = 50,
    ) -> Iterator[tuple[str, str]]:
        """(label, line) of the job's logs: the last `lines` of each, then new ones until the
        job ends. A scheduler whose logs are files this host reads says where they are
        (`log_files`); one whose logs live elsewhere overrides this."""
        name, log_dir, live, check_every = self.log_files(handle)
        return logfiles.job_lines(name, log_dir, role, index, follow=follow, lines=lines,
                                  live=live, check_every=check_every)  # fmt: skip

    def log_files(self, handle: Handle) -> tuple[str, Path, Callable[[], bool], float]:
        """The job's name, its log folder, whether it still runs (asked while following) and
        how often to ask (0: at every pause of its files)."""
        raise NotImplementedError(f"{type(self).__name__} reads no log files: override log_iter")

    @abstractmethod
    def cancel(self, handle: Handle, timeout: float = 30.0) -> StopResult: ...

    def opened_registry(self):
        """The registry of this scheduler's jobs (its `registry` URL, else the default),
        opened once: the command's discovery, the plan and a foreground run share it."""
        reg = self.__dict__.get("_opened_registry")
        if reg is None:
            from areal_cli.registry import open_registry

            reg = self._opened_registry = open_registry(getattr(self, "registry", None))
        return reg

    def request_stop(self) -> None:
        """Ask a job running in the foreground of this process to stop (signal handlers)."""
        return None

    def check_rows(self, registry: str | None) -> list:
        """Its rows in `areal doctor check --scheduler NAME` (diagnose.check.Row): whether
        this host can run jobs on it. None for a scheduler of this host alone."""
        return []

    def run_on_nodes(
        self, job_id: str, commands: dict[str, list[str]], timeout: float
    ) -> dict[str, tuple[str | None, str | None]]:
        """node → (stdout, why not) of a short command run on each named node of a job of
        this scheduler, all at once: how the doctor reaches the nodes of a cluster job. A
        scheduler whose jobs run on this host only has none."""
        raise UsageError(f"the {self.name} scheduler cannot reach other nodes")
