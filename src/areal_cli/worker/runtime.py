"""What a training worker learns from its launcher: rank, device, mesh, and where the servers are.

`areal train` starts the script under torchrun and exports:

    AREAL_LLM_SERVER_ADDRS  host:port,host:port   healthy inference servers
    AREAL_SERVER_BACKEND    sglang | vllm | hf
    AREAL_API_KEY           when the servers want one
    AREAL_ALLOC             the allocation, e.g. "fsdp:d2" or "sglang:d1+fsdp:d2t2"
    AREAL_MESH              its training mesh, e.g. "pp=1,dp=2,cp=1,tp=2" (areal_cli.parallel)
    AREAL_LOG_DIR           the job's log folder
    AREAL_EXPERIMENT, AREAL_TRIAL, AREAL_REGISTRY

plus torchrun's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. A script started
with plain `python` gets a world of one.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_cli import discovery, procs, settings
from areal_cli.backends import FALLBACK
from areal_cli.errors import ArealError, UsageError, WaitTimeout
from areal_cli.parallel import ParallelDims, fsdp_mesh
from areal_cli.registry import RankEntry, open_registry
from areal_cli.worker import (
    channel,
    consistency,
    context,
    memory,  # noqa: F401  (its doctor requests, on the rank's channel)
)
from areal_cli.worker.rollout import RolloutClient, registry_view

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class WorkerContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh  # dims in ParallelDims order: pp, dp, cp, tp (dp always, others when > 1)
    dims: ParallelDims
    servers: list[str]
    backend: str
    api_key: str | None
    log_dir: Path
    experiment: str
    trial: str
    alloc: str | None

    _rank_entry: Any = None  # (registry, entry, stop) while this rank is recorded

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.mesh["dp"]

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """What FSDP shards over: dp, or dp and cp flattened (dp_cp) when c > 1."""
        return fsdp_mesh(self.mesh)

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.dp_mesh.size()

    def progress(self, step: int | None = None) -> None:
        """Tell the watchdog this rank moved on (call it once per training step): a job none of
        whose ranks report for `--watchdog` seconds gets the hang doctor. Costs nothing to
        speak of (no I/O; the doctor asks for it over the rank's channel)."""
        channel.report_progress(step)
        if step is not None and consistency.armed():
            consistency.at_step(step)  # `areal doctor diverge`: here all ranks meet at `step`

    def barrier(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()

    def rollout_client(self, **kwargs: Any) -> RolloutClient:
        """A RolloutClient on this job's servers. Keyword arguments override its defaults,
        the timeouts among them: `timeout` (one generation request, 600 s), `control_timeout`
        (one pause or weight update, 600 s), `stall_timeout` and `probe_timeout` (a server
        silent that long, then deaf to a cheap question that long, is hung: 10 s + 5 s),
        `cooldown` (how long a failed server is skipped at first, 5 s)."""
        if not self.servers:
            raise UsageError(
                "no inference servers known to this worker (AREAL_LLM_SERVER_ADDRS is empty)",
                hint="start servers with `areal serve`, then launch with `areal train`",
            )
        kwargs.setdefault("backend", self.backend)
        kwargs.setdefault("api_key", self.api_key)
        if os.environ.get("AREAL_REGISTRY"):
            # A server its runner restarts (base weights again) is told by the registry.
            view = registry_view(os.environ["AREAL_REGISTRY"], self.experiment, self.trial)
            kwargs.setdefault("discover", view)
        return RolloutClient(self.servers, **kwargs)

    def close(self) -> None:
        """Destroy the process group; `connect()` afterwards starts a fresh one."""
        import torch.distributed as dist

        if dist.is_initialized():
            # Leave together: a rank that tears gloo down while its peer still talks to it
            # aborts the peer ("terminate called without an active exception").
            try:
                dist.barrier()
            except RuntimeError:
                pass
            dist.destroy_process_group()
        if self._rank_entry is not None:
            reg, entry, stop = self._rank_entry
            stop.set()
            try:
                reg.deregister_rank(entry)
            except Exception:
                pass
            self._rank_entry = None
        channel.stop()
        if context.CURRENT is self:
            context.CURRENT = None
        import gc

        gc.collect()  # free the groups' C++ side now, while the interpreter is whole


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not an integer") from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connect(*, timeout_s: float = 600.0) -> WorkerContext:
    """Join the job: init the process group and device mesh, read the servers. Idempotent."""
    if context.CURRENT is not None:
        return context.CURRENT

    import datetime

    import torch
    import torch.distributed as dist

    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    if "RANK" not in os.environ:
        # Plain `python train.py`: a world of one, rendezvous on a private port.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))

    alloc = os.environ.get("AREAL_ALLOC") or None
    dims = ParallelDims.from_env(os.environ, world_size)

    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        device_type, pg_backend = "cuda", "nccl"
    else:
        device = torch.device("cpu")
        device_type, pg_backend = "cpu", "gloo"

    if not dist.is_initialized():
        dist.init_process_group(
            backend=pg_backend,
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    mesh = dims.build_mesh(device_type)
    # The doctor's way in: a thread of this rank's own answers it even while the main
    # thread sits in a collective (the flight recorder's dump, the last step).
    channel.start(os.environ.get("AREAL_HOME") or None)

    experiment = os.environ.get("AREAL_EXPERIMENT") or settings.DEFAULT_EXPERIMENT
    trial = os.environ.get("AREAL_TRIAL") or settings.DEFAULT_TRIAL
    servers = [a.strip() for a in os.environ.get("AREAL_LLM_SERVER_ADDRS", "").split(",")]
    servers = [a for a in servers if a]
    backend = os.environ.get("AREAL_SERVER_BACKEND") or FALLBACK
    api_key = os.environ.get("AREAL_API_KEY") or None
    if not servers and os.environ.get("AREAL_WAIT_SERVERS"):
        servers, backend, api_key = _discover(experiment, trial, rank, world_size)
    log_dir = Path(os.environ.get("AREAL_LOG_DIR") or Path.cwd() / "areal-logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    ctx = context.CURRENT = WorkerContext(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=device,
        mesh=mesh,
        dims=dims,
        servers=servers,
        backend=backend,
        api_key=api_key,
        log_dir=log_dir,
        experiment=experiment,
        trial=trial,
        alloc=alloc,
    )
    ctx._rank_entry = _register_rank(experiment, trial, rank, local_rank, world_size)
    return ctx


def _discover(experiment: str, trial: str, rank: int, world_size: int):
    """Servers started beside the trainers (one cluster job) are known only at run time:
    rank 0 waits for them in the registry, as `areal train` does, and tells every rank, so all
    ranks use the same servers."""
    import torch.distributed as dist

    found: list = [None]
    if rank == 0:
        try:
            got = discovery.from_registry(
                open_registry(os.environ.get("AREAL_REGISTRY")),
                settings.home(),
                experiment,
                trial,
                _env_int("AREAL_MIN_SERVERS", 1),
                float(os.environ["AREAL_WAIT_SERVERS"]),
            )
            found[0] = (got.addrs, got.backend, got.api_key, None)
        except ArealError as e:
            found[0] = ([], "", None, e.message)
    if world_size > 1:
        dist.broadcast_object_list(found, src=0)
    addrs, backend, key, error = found[0]
    if error:
        raise WaitTimeout(error)
    return addrs, backend or FALLBACK, key


def _register_rank(experiment: str, trial: str, rank: int, local_rank: int, world_size: int):
    """Record this rank in the job's registry while it lives (host, pid, ranks, the job), so
    the doctor finds every rank on every node. Training goes on if the registry cannot be
    written; the doctor then falls back to looking at processes."""
    url = os.environ.get("AREAL_REGISTRY")
    if not url:
        return None
    import logging
    import threading

    try:
        reg = open_registry(url)
        entry = RankEntry(
            experiment=experiment, trial=trial, rank=rank, local_rank=local_rank,
            world_size=world_size, host=settings.hostname(), pid=os.getpid(),
            pid_create_time=procs.create_time(os.getpid()), job=f"{experiment}/{trial}",
            marker=os.environ.get(procs.MARKER_ENV),
            scheduler=os.environ.get("AREAL_SCHEDULER_NAME", "local"),
            # What the scheduler told the job's processes (launchers/node.py).
            scheduler_job_id=os.environ.get("AREAL_SCHEDULER_JOB_ID"),
            node=(
                os.environ.get("AREAL_NODE_NAME")
                or settings.hostname()
            ),
        )  # fmt: skip
        reg.register_rank(entry, ttl=settings.registry_ttl())
    except Exception as e:
        logging.getLogger("areal").warning("rank %d not recorded in the registry: %s", rank, e)
        return None
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(entry.ttl / 3):
            try:
                reg.keepalive_rank(entry)
            except Exception:
                try:
                    # The registry lost it (a restart): add it again.
                    reg.register_rank(entry, ttl=entry.ttl)
                except Exception:
                    pass

    threading.Thread(target=renew, name="areal-rank-lease", daemon=True).start()
    return reg, entry, stop


def close() -> None:
    """Tear down the context `connect()` made, if any."""
    if context.CURRENT is not None:
        context.CURRENT.close()
