"""Pure data: what a job is (JobSpec) and the concrete processes it becomes (Plan).

flags + YAML → JobSpec → Scheduler.dryrun() → Request (a Plan) → Scheduler.schedule()
→ processes → registry.
Nothing here starts a process or touches the network.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from areal_cli.alloc import Allocation, parse
from areal_cli.parallel import ParallelDims


@dataclass(frozen=True)
class ServerRole:
    """d replicas of one inference backend, each on gpus_per_replica GPUs."""

    backend: str  # sglang | vllm | hf
    model_path: str  # an absolute local directory or a hub id (see areal_cli.models)
    replicas: int
    tp: int = 1
    pp: int = 1
    host: str = "127.0.0.1"
    port_base: int | None = None  # explicit: ports port_base.. must be free
    python: str = ""  # interpreter that runs the server (its own virtualenv)
    extra_args: tuple[str, ...] = ()
    seed: int = 1
    name: str | None = None
    revision: str | None = None  # of a hub id
    # Bind a server whose control routes nothing guards (vLLM's) beyond loopback anyway.
    allow_unauthenticated_control: bool = False
    # Restarts of a replica whose server exited, per rolling hour (0: never restarted).
    max_restarts: int = 3

    @property
    def gpus_per_replica(self) -> int:
        return self.tp * self.pp


@dataclass(frozen=True)
class TrainerRole:
    """torchrun workers for one train component."""

    script: str
    script_args: tuple[str, ...]
    nproc: int
    alloc: str
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    python: str = ""
    env: tuple[tuple[str, str], ...] = ()  # extra environment for the workers
    # Append AReaL config overrides that point an AReaL entry point at our servers.
    areal_overrides: bool = False
    # AReaL's version in `python` (areal_entry.probe): which overrides it understands.
    areal_version: str = ""


@dataclass(frozen=True)
class Asked:
    """What a user asked of `areal serve` or `areal train`, parsed once: each option's value
    (a flag over the job YAML over the option's own default), the options given on the
    command line, and the job YAML as read (keys with underscores; those without a flag,
    such as `scheduler_opts`, are read from here)."""

    values: dict
    flags: frozenset = frozenset()
    job_yaml: dict = field(default_factory=dict)

    def __getitem__(self, key: str):
        return self.values[key]

    def given(self, keys) -> dict:
        """Those of `keys` given on the command line, with their values."""
        return {k: self.values[k] for k in keys if k in self.flags}


@dataclass(frozen=True)
class SchedulerOpts:
    """The options of the job's scheduler, by name: each scheduler declares its own
    (Scheduler.runopts; Slurm's partition, Ray's address). One not set reads as None."""

    values: tuple[tuple[str, object], ...] = ()

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return dict(object.__getattribute__(self, "values")).get(name)

    def given(self) -> list[str]:
        return [k for k, v in self.values if v not in (None, (), [])]


@dataclass(frozen=True)
class JobSpec:
    experiment: str
    trial: str
    servers: ServerRole | None = None
    trainer: TrainerRole | None = None
    alloc: str | None = None
    gpus_flag: str | None = None  # --gpus as given
    api_key: str = "auto"  # "auto" (a generated key, loopback too) | "none" | a key
    health_timeout: float = 600.0
    # Servers a training-only job found in the registry or got from --servers.
    external_servers: tuple[str, ...] = ()
    external_backend: str | None = None
    external_api_key: str | None = None
    scheduler_opts: SchedulerOpts = SchedulerOpts()
    # The watchdog on training: seconds without progress that make a stall (0: off), and
    # what a stall does (observe: a verdict and a bundle; fail: that, then the job ends, exit 1).
    watchdog: float = 300.0
    watchdog_action: str = "observe"
    # `--watchdog auto`: the limit follows the job's step time, `watchdog` seconds at most
    # and before steps are timed (diagnose.watchdog.auto_limit).
    watchdog_auto: bool = True
    # Restarts of the trainers after a failure (areal train --max-restarts) and what may
    # restart: infra (the root cause's restart column decides) | any.
    max_restarts: int = 0
    restart_on: str = "infra"
    # `alloc` parsed, by whoever built the spec (the command parses --alloc once); a spec
    # built from the text alone is parsed on first use, and only then.
    allocation: Allocation | None = field(default=None, compare=False, repr=False)

    def parsed_alloc(self) -> Allocation | None:
        text = self.alloc or (self.trainer.alloc if self.trainer else None)
        if self.allocation is None and text:
            object.__setattr__(self, "allocation", parse(text))
        return self.allocation

    def train_dims(self):
        """The training component's parallel dims (ParallelDims), from the parsed allocation."""
        a = self.parsed_alloc()
        return ParallelDims.from_component(a.train or a.components[0])

    @property
    def world_size(self) -> int:
        """The training ranks of the job (0 for serving only)."""
        return self.train_dims().world_size if self.trainer else 0

    @property
    def kind(self) -> str:
        if self.servers and self.trainer:
            return "serve+train"
        return "serve" if self.servers else "train"


@dataclass
class ProcessPlan:
    role: str  # "server" | "trainer"
    index: int
    argv: list[str]
    env: dict[str, str]  # added on top of the caller's environment
    gpus: list[int]
    log_path: str
    host: str | None = None
    port: int | None = None
    backend: str | None = None
    health_path: str | None = None  # polled until 200 before the process counts as ready
    # Cores the process is pinned to (an engine's CPU build on a host without GPUs).
    cpus: list[int] = field(default_factory=list)
    # [path, JSON body]: one tiny request sent after /health says 200, before the server
    # counts as ready: an engine can die on its first real request.
    first_request: list | None = None

    @property
    def label(self) -> str:
        return "torchrun" if self.role == "trainer" else f"{self.role}-{self.index}"

    @property
    def addr(self) -> str | None:
        return f"{self.host}:{self.port}" if self.port else None


@dataclass
class Plan:
    experiment: str
    trial: str
    kind: str
    log_dir: str
    registry: str
    marker: str
    home: str = ""  # AREAL_HOME of the job: records, logs, the API key
    alloc: str | None = None
    processes: list[ProcessPlan] = field(default_factory=list)
    api_key: str | None = None  # never printed; the plan shows whether one is set
    api_key_file: str | None = None
    health_timeout: float = 600.0
    model_path: str | None = None
    tp: int = 1
    scheduler: str = "local"
    registry_ttl: float = 30.0  # seconds a registered server outlives its last renewal
    server_restarts: int = 0  # restarts of each server replica per rolling hour (0: none)
    watchdog: float = 0.0  # seconds without progress of any rank that make a stall (0: off)
    watchdog_action: str = "observe"  # observe | fail
    watchdog_auto: bool = False  # the limit follows the step time, `watchdog` at most (auto)
    max_restarts: int = 0  # restarts of the trainers after a failure (diagnose.restart)
    restart_on: str = "infra"  # infra | any
    # What a reader of the plan should know that its processes do not show (--dry-run).
    notes: list[str] = field(default_factory=list)

    @property
    def servers(self) -> list[ProcessPlan]:
        return [p for p in self.processes if p.role == "server"]

    @property
    def trainers(self) -> list[ProcessPlan]:
        return [p for p in self.processes if p.role == "trainer"]

    def to_json(self, redact: bool = True) -> dict:
        d = asdict(self)
        if redact:
            d["api_key"] = "<set>" if self.api_key else None
            for p in d["processes"]:
                p["argv"] = self.redact(p["argv"])
                p["env"] = {k: ("<api-key>" if _is_key_var(k) else v) for k, v in p["env"].items()}
        return d

    @staticmethod
    def redact(argv: list[str]) -> list[str]:
        """argv with the value of any --api-key replaced (only there: a key of "1" must not
        hide every 1 of the command line)."""
        out, prev = [], None
        for a in argv:
            if prev == "--api-key":
                out.append("<api-key>")
            elif a.startswith("--api-key="):
                out.append("--api-key=<api-key>")
            else:
                out.append(a)
            prev = a
        return out

    @classmethod
    def from_json(cls, d: dict) -> Plan:
        d = dict(d)
        d["processes"] = [ProcessPlan(**p) for p in d.get("processes", [])]
        return cls(**d)


def _is_key_var(name: str) -> bool:
    return name.endswith("API_KEY")
