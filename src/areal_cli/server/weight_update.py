"""SGLang's distributed weight update on the hf server: groups, the begin/end session, staging.

    POST /init_weights_update_group       join a group as rank rank_offset (this server has
                                          one TP rank); the rendezvous runs off the event loop
    POST /begin_weight_update             open the session 0.5.23 requires
    POST /update_weights_from_distributed receive one broadcast (per tensor, or one
                                          `flattened_bucket`) and check it against the model;
                                          outside a session (0.5.10.post1's protocol, which
                                          AReaL's trainer speaks) it is a session of its own
    POST /end_weight_update               install what the session received, in one swap
    POST /destroy_weights_update_group

Texts and status codes follow srt/managers/scheduler_components/weight_updater.py:165-340 and
srt/model_executor/model_runner_components/weight_updater.py:100-160.

Where the hf server is stricter than SGLang, it is so that a served model is always all old
or all new: received tensors are staged and installed only at /end_weight_update, and only
if every update of the session succeeded. SGLang loads each request's tensors at once, so a
failure half way leaves it "partially updated". A tensor whose name, dtype or shape does not
match the served model fails its request with 400 (the broadcast is still received, so the
trainer's collective completes) and the session installs nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from areal_cli.backends import weight_group
from areal_cli.backends.weight_group import TensorMeta

log = logging.getLogger("areal.server")

# A request may describe at most this many times the served model's bytes: anything bigger
# is refused before a single byte is received.
MAX_REQUEST_OVER_MODEL = 2

# Which trainer owns the weights: a token, a name for messages, and "host:pid" of its process.
OWNER_HEADER = "X-Areal-Weight-Owner"
OWNER_NAME_HEADER = "X-Areal-Weight-Owner-Name"
OWNER_PROCESS_HEADER = "X-Areal-Weight-Owner-Process"
# An owner that sent nothing for this long is gone (a trainer on another host that died).
OWNER_TTL_S = 300.0


class WeightOwner:
    """One trainer owns the served weights at a time, so two trainers pointed at the same
    servers cannot interleave their syncs (each closing the other's session, the weights
    alternating under the same version labels).

    A trainer's weight-control request carrying its token takes ownership when nobody holds
    it; any request of the owner renews it; another token is refused at once, naming the
    owner. Ownership ends when the owner releases it (its client closes), when its process
    on this host is gone, or `ttl_s` after the owner's last request. Requests without a token
    (SGLang's own clients, areal's resume of a dead trainer's pause) are not affected.
    """

    def __init__(self, ttl_s: float = OWNER_TTL_S):
        self.ttl_s = ttl_s
        self.token: str | None = None
        self.name = ""
        self.process = ""
        self.since = 0.0
        self.seen = 0.0

    def claim(self, token: str, name: str, process: str) -> str | None:
        """None when `token` owns the weights (now or already); else why it may not."""
        now = time.monotonic()
        if self.token is not None and self.token != token:
            why = self._gone(now)
            if why is None:
                return (
                    f"this server's weights belong to another trainer, {self.name}, since "
                    f"{now - self.since:.0f}s (its last request {now - self.seen:.0f}s ago); "
                    "stop that trainer or point this one at other servers"
                )
            log.warning("weights owner %s released: %s", self.name, why)
        if self.token != token:
            self.token, self.name, self.process, self.since = token, name, process, now
            log.info("weights now owned by %s", name)
        self.seen = now
        return None

    def renew(self, token: str) -> None:
        if token == self.token:
            self.seen = time.monotonic()

    def release(self, token: str) -> bool:
        if token != self.token:
            return False
        log.info("weights owner %s released its ownership", self.name)
        self.token = None
        return True

    def describe(self) -> dict[str, Any] | None:
        if self.token is None:
            return None
        now = time.monotonic()
        return {"name": self.name, "since_s": round(now - self.since, 1),
                "idle_s": round(now - self.seen, 1)}  # fmt: skip

    def _gone(self, now: float) -> str | None:
        if now - self.seen > self.ttl_s:
            return f"no request for {now - self.seen:.0f}s"
        host, _, pid = self.process.rpartition(":")
        if host == socket.gethostname() and pid.isdigit():
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                return f"its process {pid} is gone"
            except OSError:  # alive, another user's
                pass
        return None


@dataclass
class _Group:
    name: str
    group: weight_group.Group | None = None  # None while the rendezvous runs
    busy: bool = False  # a receive is in flight


@dataclass
class _Session:
    staged: dict[str, Any] = field(default_factory=dict)
    version: str | None = None
    broken: str | None = None  # why nothing will be installed
    in_flight: int = 0
    groups: set[str] = field(default_factory=set)  # the groups it received from


class WeightUpdates:
    def __init__(self, engine: Any, batcher: Any, timeout_s: float):
        self.engine = engine
        self.batcher = batcher
        self.timeout_s = timeout_s
        self.groups: dict[str, _Group] = {}
        self.session: _Session | None = None
        self._model_bytes: int | None = None
        # The tensors the last update replaced: the next one receives into them, so a sync
        # allocates nothing (and touches no fresh page) on the server.
        self._spares: dict[str, Any] = {}

    # -- groups -------------------------------------------------------------------------------

    async def init_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> tuple[bool, str]:
        if not group_name:
            return False, "Failed to initialize custom process group: Group name cannot be empty."
        if group_name in self.groups:
            # What torch's group helper raises for a name in use (distributed_c10d.py).
            return False, (
                "Failed to initialize custom process group: The specified group name has "
                "already been created, please use a different group name."
            )
        entry = _Group(group_name)
        self.groups[group_name] = entry
        if self.session is not None and self.session.staged:
            # A new group while a session holds a partial update: its sender is gone (a
            # trainer restarted); what it sent so far must never be installed.
            self.session.broken = f"a new group {group_name} was made during the session"
        rank = rank_offset  # one TP rank: tp_rank 0
        log.info(
            "init custom process group: master_address=%s, master_port=%s, rank_offset=%s, "
            "rank=%s, world_size=%s, group_name=%s, backend=%s",
            master_address, master_port, rank_offset, rank, world_size, group_name, backend,
        )  # fmt: skip
        try:
            if backend == "nccl" and not str(self.engine.device).startswith("cuda"):
                raise ValueError("backend nccl needs a CUDA device; this server runs on the CPU")
            if not 0 < rank < world_size:
                raise ValueError(f"rank {rank} is outside the group of {world_size}")
            entry.group = await asyncio.to_thread(
                weight_group.join,
                master_address=master_address,
                master_port=master_port,
                rank=rank,
                world_size=world_size,
                group_name=group_name,
                backend=backend,
                timeout_s=self.timeout_s,
            )
            if not self._spares:
                self._spares = await asyncio.to_thread(self._blank_spares, entry.group.device)
        except Exception as e:
            self.groups.pop(group_name, None)
            message = f"Failed to initialize custom process group: {e}."
            log.error(message)
            return False, message
        return True, "Succeeded to initialize custom process group."

    async def destroy_group(self, group_name: str) -> tuple[bool, str]:
        entry = self.groups.pop(group_name, None)
        if entry is None:
            return False, "The group to be destroyed does not exist."
        if self.session is not None and group_name in self.session.groups:
            self.session.broken = f"group {group_name} was destroyed during the session"
        if entry.group is not None:
            # Not on the event loop: a receive blocked on a hung peer makes the teardown
            # wait for it, and /health, /pause_generation ... must go on answering.
            weight_group.close_soon(entry.group, 0)
        return True, "Succeeded to destroy custom process group."

    def stats(self) -> dict[str, Any]:
        s = self.session
        return {
            "groups": sorted(self.groups),
            "session_open": s is not None,
            "staged_tensors": len(s.staged) if s else 0,
            "receiving": bool(s and s.in_flight),
        }

    def close(self) -> None:
        for entry in self.groups.values():
            if entry.group is not None:
                weight_group.close_soon(entry.group, 1.0)
        self.groups.clear()

    # -- the session ----------------------------------------------------------------------------

    def begin(self) -> tuple[bool, str]:
        if self.session is not None:
            return False, (
                "a weight-update session is already open; call end_weight_update() first"
            )
        self.session = _Session()
        return True, "Success"

    async def end(self) -> tuple[bool, str]:
        session, self.session = self.session, None
        if session is None:
            return False, "no weight-update session is open; call begin_weight_update() first"
        if session.in_flight and not session.broken:
            session.broken = "the session ended while a receive was still running"
        if session.broken:
            log.warning("weight update discarded, weights unchanged: %s", session.broken)
        elif session.staged:
            started = time.perf_counter()
            old = self.batcher.weight_version
            device = str(self.engine.device)
            if all(str(t.device).split(":")[0] == device.split(":")[0]
                   for t in session.staged.values()):  # fmt: skip
                self._spares = await self.batcher.adopt_weights(session.staged, session.version)
            else:  # received on the CPU (gloo) for a model on a GPU
                await self.batcher.swap_weights(session.staged, None, session.version)
            log.info(
                "weights updated from distributed: %d tensors, version %s -> %s in %.2fs",
                len(session.staged), old, self.batcher.weight_version,
                time.perf_counter() - started,
            )  # fmt: skip
        return True, "Success"

    # -- one update -----------------------------------------------------------------------------

    async def update(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None,
        load_format: str | None,
    ) -> tuple[bool, str]:
        session = self.session
        if session is None:
            return False, (
                "update_weights_from_distributed must run between begin_weight_update() "
                "and end_weight_update()"
            )
        entry = self.groups.get(group_name)
        try:
            if entry is None or entry.group is None:
                raise ValueError(
                    f"Group {group_name} not in {list(self.groups)}. "
                    "Please call `init_weights_update_group` first."
                )
            if entry.busy:
                raise ValueError(f"group {group_name} is already receiving")
            metas = _metas(names, dtypes, shapes)
            if load_format == "flattened_bucket":
                weight_group.bucket_layout(metas)  # refuses negative or unaligned entries
            total = sum(m.nbytes() for m in metas)
            limit = MAX_REQUEST_OVER_MODEL * self._served_bytes()
            if total > limit:
                raise ValueError(
                    f"the request describes {total} bytes, more than {MAX_REQUEST_OVER_MODEL}x "
                    f"the served model ({limit // MAX_REQUEST_OVER_MODEL} bytes)"
                )
        except Exception as e:
            session.broken = session.broken or str(e)
            message = f"Failed to receive weights: {e}"
            log.error(message)
            return False, message

        entry.busy = True
        session.in_flight += 1
        session.groups.add(group_name)
        try:
            flattened = load_format == "flattened_bucket"
            buffers = {} if flattened else self._take_spares(metas, entry.group.device)
            received = await asyncio.to_thread(
                _receive, entry.group, metas, flattened, self.timeout_s, buffers
            )
        except Exception as e:
            session.broken = session.broken or f"receive failed: {e}"
            message = f"Failed to receive weights: {e}"
            log.error(message)
            return False, message
        finally:
            entry.busy = False
            session.in_flight -= 1

        mismatch = _mismatch(metas, self.engine.tensor_specs())
        if mismatch:
            session.broken = session.broken or mismatch
            message = (
                f"Failed to update parameter online: {mismatch}. The served weights are "
                "unchanged; this weight-update session will install nothing."
            )
            log.error(message)
            return False, message
        if session is not self.session or session.broken:
            # Destroyed, ended or failed while this receive ran: nothing of it is installed.
            return False, f"Failed to receive weights: {session.broken or 'session ended'}"
        session.staged.update(received)
        if weight_version is not None:
            session.version = weight_version
        message = "Succeeded to update parameter online."
        if weight_version is not None:
            message += f" Weight version updated to {weight_version}."
        return True, message

    def _blank_spares(self, device: str) -> dict[str, Any]:
        """Receive buffers for a whole model, their pages touched now rather than during the
        first sync."""
        import torch

        if device != str(self.engine.device).split(":")[0]:
            return {}
        return {n: torch.zeros_like(t) for n, t in self.engine.model.state_dict().items()}

    def _take_spares(self, metas: list[TensorMeta], device: str) -> dict[str, Any]:
        out = {}
        for m in metas:
            t = self._spares.get(m.name)
            if (
                t is not None
                and str(t.dtype).removeprefix("torch.") == m.dtype
                and tuple(t.shape) == m.shape
                and t.device.type == device
            ):
                out[m.name] = self._spares.pop(m.name)
        return out

    def _served_bytes(self) -> int:
        if self._model_bytes is None:
            self._model_bytes = sum(
                TensorMeta(n, d, s).nbytes() for n, (d, s) in self.engine.tensor_specs().items()
            )
        return self._model_bytes


def _metas(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[TensorMeta]:
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, "
            f"{len(shapes)})"
        )
    metas = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if not isinstance(name, str) or not isinstance(dtype, str) or not isinstance(shape, list):
            raise ValueError("names and dtypes must be strings, shapes lists of integers")
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise ValueError(f"the shape of {name} is not a list of integers: {shape}")
        if any(d < 0 for d in shape):
            raise ValueError(f"Negative dimension in received tensor {name}: {shape}")
        weight_group.torch_dtype(dtype)
        metas.append(TensorMeta(name, dtype, tuple(shape)))
    return metas


def _receive(
    group: weight_group.Group,
    metas: list[TensorMeta],
    flattened: bool,
    timeout_s: float,
    buffers: dict[str, Any],
) -> dict[str, Any]:
    import torch

    if flattened:
        layout = weight_group.bucket_layout(metas)
        bucket = torch.empty(layout[-1][1], dtype=torch.uint8, device=group.device)
        group.broadcast(bucket, timeout_s)
        return weight_group.unflatten(bucket, metas)
    out = {}
    for m in metas:
        t = buffers.get(m.name)
        if t is None:
            t = torch.empty(m.shape, dtype=weight_group.torch_dtype(m.dtype), device=group.device)
        out[m.name] = t
    group.broadcast_all(list(out.values()), timeout_s)
    return out


def _mismatch(metas: list[TensorMeta], specs: dict[str, tuple[str, tuple[int, ...]]]) -> str:
    for m in metas:
        if m.name not in specs:
            return f"the served model has no tensor {m.name}"
        dtype, shape = specs[m.name]
        if m.dtype != dtype:
            return f"{m.name} was sent as {m.dtype}; the served model holds {dtype}"
        if tuple(m.shape) != shape:
            return f"{m.name} has shape {list(m.shape)}; the served model's is {list(shape)}"
    return ""
