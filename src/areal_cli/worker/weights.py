"""Weight sync: gather the sharded model on rank 0, then get it to every inference server.

Two methods, as AReaL and slime have them:

    distributed  rank 0 joins a process group with every server's TP ranks (rank_offset =
                 1 + sum of tp*pp of the servers before) and broadcasts the full state dict
                 in buckets, while the HTTP requests that make the servers receive them run
                 in the background. Those requests, and how the group is built and dropped,
                 are the engine's steps (backends/weight_sync.py: SGLang's in sync_sglang.py,
                 vLLM's native weight transfer in sync_vllm.py), found by the protocol the
                 client speaks; this module only orchestrates them. The group is made once
                 per client and reused; when a server fails or the set of servers changes,
                 the next sync builds a new one.
    disk         rank 0 writes an HF checkpoint; every server loads it from disk.

Every rank calls `sync_weights` (the gather is a collective); rank 0 talks to the servers,
around a pause of generation; a broadcast of the outcome at the end means no rank starts
sampling before the servers hold the new weights, and every rank raises if none does.

A server that dies or hangs during a sync does not stop it: the sync goes on with the
servers that answer (a broken group is rebuilt without the server), rank 0 logs the one
that did not, and the result says which server holds which version. The client stops
sampling from a server that missed a sync until a later one reaches it. A sync that fails
resumes every server it paused that still answers, and raises naming each server with its
answer; a server restarted at the same address (another instance id, or a group it no
longer knows) gets a new group, and is not taken to hold our weights.

One trainer owns a server's weights at a time (the hf server enforces it: another trainer's
sync is refused at once, naming the owner). Closing the client, or the interpreter's exit,
destroys its group on every server and gives the ownership up.
"""

from __future__ import annotations

import asyncio
import atexit
import copy
import errno
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_cli.backends import weight_group
from areal_cli.backends.weight_sync import Push, WeightSync, steps_for
from areal_cli.errors import UsageError
from areal_cli.worker.channel import report_progress
from areal_cli.worker.rollout import RolloutClient, RolloutError, SyncError, unreachable

if TYPE_CHECKING:
    import torch

log = logging.getLogger("areal.worker")

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# Written from the model itself, never copied from the source checkpoint.
_OWN_FILES = {"config.json"}


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _architecture(model: torch.nn.Module) -> str:
    # FSDP2 swaps the class for a subclass named "FSDP<Name>"; the checkpoint must name the
    # class transformers knows.
    for cls in type(model).__mro__:
        if not cls.__name__.startswith("FSDP"):
            return cls.__name__
    return type(model).__name__


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights as plain CPU tensors (collective: every rank must call).

    Ranks other than 0 get an empty dict: only rank 0 keeps the gathered copy.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if dist.is_initialized():
        state = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    else:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _copy_support_files(source: Path, target: Path) -> list[str]:
    copied = []
    for item in sorted(source.iterdir()):
        if (
            not item.is_file()
            or item.name in _OWN_FILES
            or item.name in _WEIGHT_INDEXES
            or item.suffix in _WEIGHT_SUFFIXES
        ):
            continue
        shutil.copy2(item, target / item.name)
        copied.append(item.name)
    return copied


def save_hf_checkpoint(
    model: torch.nn.Module,
    path: str | Path,
    *,
    tokenizer_from: str | Path | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 1024**3,
) -> Path:
    """Write `model` (sharded with FSDP2 or not) as a Hugging Face checkpoint directory.

    Collective: every rank calls it; rank 0 writes. The directory appears whole or not at
    all (written beside it, then renamed), so a server never loads a half-written
    checkpoint. `tokenizer_from` is the source model directory: its tokenizer, generation
    config and any other non-weight files are copied over. `dtype` casts floating weights
    (e.g. torch.bfloat16 for serving).
    """
    from safetensors.torch import save_file

    target = Path(path).expanduser().resolve()
    state = full_state_dict(model)
    if _rank() == 0:
        config = copy.deepcopy(getattr(model, "config", None))
        if config is None:
            raise UsageError(
                f"{type(model).__name__} has no .config; save_hf_checkpoint needs a "
                "transformers PreTrainedModel"
            )
        if getattr(config, "tie_word_embeddings", False):
            # transformers re-ties the head on load; safetensors refuses shared storage anyway.
            state.pop("lm_head.weight", None)
        tensors: dict[str, torch.Tensor] = {}
        for name, t in state.items():
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            tensors[name] = t.contiguous()

        staging = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
        staging.mkdir(parents=True)
        try:
            if not getattr(config, "architectures", None):
                config.architectures = [_architecture(model)]
            if dtype is not None:
                config.dtype = dtype
            config.save_pretrained(staging)
            _write_safetensors(tensors, staging, max_shard_bytes, save_file)
            if tokenizer_from is not None:
                _copy_support_files(Path(tokenizer_from).expanduser(), staging)
            _replace_dir(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    _barrier()
    return target


def _write_safetensors(tensors, out: Path, max_shard_bytes: int, save_file) -> None:
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _replace_dir(staging: Path, target: Path) -> None:
    if target.exists():
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(target, old)
        os.replace(staging, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, target)


METHODS = ("distributed", "disk")
DEFAULT_BUCKET_BYTES = 256 << 20
_SERVING_DTYPES = ("float32", "bfloat16", "float16")
# How long dropping a group may hold up the sync (a hung peer can make it take the timeout).
CLOSE_WAIT_S = 1.0


def sync_weights(
    model: torch.nn.Module,
    client: RolloutClient,
    path: str | Path | None = None,
    *,
    method: str | None = None,
    version: str | int | None = None,
    tokenizer_from: str | Path | None = None,
    dtype: torch.dtype | None = None,
    pause_mode: str | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    timeout: float = 600.0,
    flatten: bool | None = None,
) -> dict[str, Any]:
    """Get `model`'s weights (sharded with FSDP2 or not) to every inference server.

    Collective: every rank calls it. `method` is "distributed" (a broadcast over a process
    group) or "disk" (an HF checkpoint at `path`); without one, a `path` means disk.
    Generation pauses around the update (`pause_mode`: SGLang's retract by default, vLLM's
    keep). `version` labels the new weights on the servers; `dtype` casts floating tensors
    (by default the dtype the servers report, else the model's). `timeout` bounds the
    rendezvous and each broadcast: a server that dies mid-sync makes this raise within it,
    naming the server, instead of hanging. `flatten` sends each bucket as one SGLang
    `flattened_bucket` (True), or tensor by tensor (False); by default all are flattened
    over nccl, and over gloo only the tensors under SMALL_TENSOR_BYTES, together.

    Returns {"version", "method", "bytes", "gather_s", "transfer_s", "servers", "failed",
    "versions", ...} on every rank: `servers` got the new weights, `failed` maps each server
    that did not to why, `versions` each server to the version it holds as far as rank 0
    knows (None: unknown). It raises only when no server got them.
    `client` is only used on rank 0 (other ranks may pass theirs, it stays untouched).
    """
    method = method or ("disk" if path is not None else "distributed")
    if method not in METHODS:
        raise UsageError(f"unknown weight sync method {method!r}", hint="use distributed or disk")
    if method == "disk" and path is None:
        raise UsageError("sync_weights(method='disk') needs a path for the checkpoint")
    v = None if version is None else str(version)

    t0 = time.perf_counter()
    if method == "disk":
        target = save_hf_checkpoint(model, path, tokenizer_from=tokenizer_from, dtype=dtype)
        t1 = time.perf_counter()
        stats = {"save_s": t1 - t0}

        def push() -> dict[str, Any]:
            got = client.run(_reload(client, target, v, pause_mode))
            return {**got, "bytes": _dir_bytes(target)}
    else:
        state = full_state_dict(model)
        t1 = time.perf_counter()
        stats = {"gather_s": t1 - t0}

        def push() -> dict[str, Any]:
            if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
                state.pop("lm_head.weight", None)  # the servers tie it themselves
            return client.run(
                _send(client, state, v, dtype, pause_mode, bucket_bytes, timeout, flatten)
            )

    outcome = _shared(*_on_rank0(push))
    t2 = time.perf_counter()
    out = {
        "version": outcome["version"],
        "method": method,
        "bytes": outcome.get("bytes", 0),
        "servers": outcome.get("servers", []),
        "failed": outcome.get("failed", {}),
        "versions": outcome.get("versions", {}),
        **stats,
        "transfer_s": t2 - t1,
    }
    if method == "disk":
        out["load_s"] = t2 - t1
    report_progress(source="sync")  # the watchdog counts a finished sync as progress
    return out


def _on_rank0(push: Any) -> tuple[list[Any], Exception | None]:
    """Rank 0 pushes the weights to the servers; what came of it, ready to broadcast."""
    result: list[Any] = [None]
    error: Exception | None = None
    if _rank() == 0:
        try:
            result[0] = {"ok": True, **push()}
        except Exception as e:  # every rank must learn of it, or the others hang
            error = e
            result[0] = {"ok": False, "message": getattr(e, "message", None) or str(e)}
    return result, error


def _shared(result: list[Any], error: Exception | None) -> dict[str, Any]:
    """Rank 0's outcome on every rank; raises on every rank when the sync failed."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(result, src=0)
    outcome = result[0]
    if error is not None:
        raise error
    if not outcome["ok"]:
        raise RolloutError(f"weight sync failed on rank 0: {outcome['message']}")
    return outcome


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


async def _reload(
    client: RolloutClient, path: Path, version: str | None, pause_mode: str | None
) -> dict[str, Any]:
    _own(client)
    await client.refresh()  # a restarted server is back: this sync realigns it
    await client.pause(pause_mode)
    try:
        got = await client.update_weights_from_disk(str(path), version=version)
    finally:
        await client.resume()
    updated = [s.addr for s in client.pool if not s.stale]
    failed = {s.addr: s.last_error or "not reachable" for s in client.pool if s.stale}
    return _outcome(client, got, updated, failed)


def _outcome(
    client: RolloutClient, version: str | None, updated: list[str], failed: dict[str, str]
) -> dict[str, Any]:
    """What a sync reports: every server that did not get the weights and why (those it
    failed on, and those it skipped as down), and rank 0's line about them."""
    missed = {
        s.addr: failed.get(s.addr) or f"skipped: {s.last_error or 'not reachable'}"
        for s in client.pool
        if s.addr not in updated
    }
    # The others keep what they held (a failed update installs nothing), as last reported.
    versions = {s.addr: version if s.addr in updated else s.weight_version for s in client.pool}
    if missed:
        log.warning(
            "weight sync to version %s went on without %s; %d of %d server(s) hold it",
            version,
            "; ".join(f"{a} ({why})" for a, why in missed.items()),
            len(updated),
            len(client.pool),
        )
    return {"version": version, "servers": updated, "failed": missed, "versions": versions}


# --------------------------------------------------------------------------- distributed


@dataclass
class _Transfer:
    """One weight-update group: this process is rank 0, `servers` hold ranks 1..world-1.
    What goes over the wire to build, feed and drop it is the engine's (`steps`)."""

    name: str
    servers: list[str]
    backend: str
    world_size: int
    steps: WeightSync
    group: Any = None  # weight_group.Group, or the engine's own communicator
    dtype: str | None = None  # what the servers hold their weights in, when they say
    sent_meta: Any = None  # the metadata its servers already hold, for engines that reuse it
    # Each server's instance id when the group was made: another one at the same address
    # is a restarted server, which holds neither the group nor our weights.
    instances: dict[str, Any] = field(default_factory=dict)

    @property
    def native(self) -> bool:
        """Over the servers' own transfer engine, not a torch group."""
        return self.steps.native

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Drop the group. Gloo's abort waits for a broadcast blocked on a hung peer (up to
        the group's timeout), so the teardown runs in a thread of its own and is waited for
        only `wait_s`: the sync goes on with the other servers meanwhile."""
        group, self.group = self.group, None
        if group is not None:
            weight_group.close_soon(group, wait_s)


# One group per client, made by the first distributed sync and reused by the next ones.
_TRANSFERS: weakref.WeakKeyDictionary[Any, _Transfer] = weakref.WeakKeyDictionary()
# Clients that synced: at their close (or the interpreter's exit) their group is destroyed
# and the ownership of the servers' weights given up.
_SYNCED: weakref.WeakSet[Any] = weakref.WeakSet()
RELEASE_TIMEOUT_S = 5.0


def _own(client: RolloutClient) -> None:
    """This client syncs: its close gives its group and the servers' weights up."""
    _SYNCED.add(client)
    client.at_close(release)


def release(client: RolloutClient) -> None:
    """Destroy `client`'s weight-update group on both ends and give up the ownership of its
    servers' weights: a server keeps no group, socket or owner of a trainer that finished.
    Blocking, best effort, a few seconds at most (plain HTTP: the client's event loop may be
    closed by now)."""
    if client not in _SYNCED:
        return
    _SYNCED.discard(client)
    transfer = _TRANSFERS.pop(client, None)
    destroy: list[tuple[str, str, dict]] = []
    if transfer is not None:
        path, body = transfer.steps.destroy_request(transfer)
        destroy = [(addr, path, body) for addr in transfer.servers]
    # After the groups are gone: a request about the group would take ownership again.
    release_path = client.protocol.RELEASE_OWNER_PATH
    give_up = [(addr, release_path, {}) for addr in client.servers] if release_path else []
    headers = {"Content-Type": "application/json", **client.headers}
    for calls in (destroy, give_up):
        # Plain threads: an executor takes no work once the interpreter is exiting.
        threads = [threading.Thread(target=_post_quietly, args=(*c, headers), daemon=True)
                   for c in calls]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(RELEASE_TIMEOUT_S + 1)
        if calls is destroy and transfer is not None:
            transfer.close()  # our end last: the servers' ends are gone, nobody waits on it


def _post_quietly(addr: str, path: str, body: dict, headers: dict[str, str]) -> None:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://{addr}{path}", json.dumps(body).encode(), headers)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        opener.open(req, timeout=RELEASE_TIMEOUT_S).close()
    except (OSError, ValueError):  # gone already, or a route this server does not have
        pass


@atexit.register
def _release_all() -> None:
    for client in list(_SYNCED):
        try:
            release(client)
        except Exception:  # the interpreter is going away: never fail its exit
            pass


async def _send(
    client: RolloutClient,
    state: dict[str, Any],
    version: str | None,
    dtype: Any,
    pause_mode: str | None,
    bucket_bytes: int,
    timeout: float,
    flatten: bool | None = None,
) -> dict[str, Any]:
    """The sync, again without the servers that failed it, until it reaches every server
    left (or none is)."""
    failed: dict[str, BaseException] = {}
    rebuilt: set[str] = set()
    _own(client)
    while True:
        try:
            transfer = await _ensure_transfer(client, timeout, exclude=set(failed))
            tensors = _cast(state, dtype or transfer.dtype)
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            late = await _send_once(
                client, transfer, tensors, version, pause_mode, bucket_bytes, timeout, flatten
            )
        except SyncError as e:  # some servers failed: the others keep their old weights
            lost = {a for a, x in e.failed.items() if _steps(client).lost_group(x)} - rebuilt
            if lost and lost == set(e.failed):
                # A server that no longer knows our group was restarted (SGLang reports no
                # instance id): its weights are not ours. Once more, with a new group.
                for a in lost:
                    _restarted(client, a, "it no longer knows the weight-update group")
                rebuilt |= lost
                continue
            failed.update(e.failed)
            if not [s for s in client.reachable() if s.addr not in failed]:
                raise SyncError("weight sync", failed) from None
            log.warning("weight sync: %s failed (%s); going on without it", ", ".join(e.failed),
                        "; ".join(_why(x) for x in e.failed.values()))  # fmt: skip
            continue
        failed.update(late)
        updated = [a for a in transfer.servers if a not in late]
        client.mark_updated(updated, version)
        out = _outcome(client, version, updated, {a: _why(e) for a, e in failed.items()})
        return {**out, "bytes": total}


def _steps(client: RolloutClient) -> WeightSync:
    """The weight-sync steps of the engine the client's servers run."""
    return steps_for(client.protocol)


def _why(e: BaseException) -> str:
    return getattr(e, "message", None) or str(e) or type(e).__name__


def _restarted(client: RolloutClient, addr: str, why: str) -> None:
    log.warning("%s was restarted since the last weight sync (%s): it holds its own weights "
                "again, not the trainer's", addr, why)  # fmt: skip
    server = client.server(addr)
    server.weight_version = None
    server.stale = True  # until a sync reaches it


def _not_answering(e: BaseException) -> set[str]:
    """The servers of a failed step that gave no answer at all (refused, reset, hung):
    asking them anything more now only costs time."""
    if not isinstance(e, SyncError):
        return set()
    return {a for a, x in e.failed.items() if unreachable(x)}


def _owned_elsewhere(e: BaseException) -> set[str]:
    """The servers that refused a step because another trainer owns their weights: their
    pause, if any, is that trainer's to end."""
    if not isinstance(e, SyncError):
        return set()
    return {a for a, x in e.failed.items() if "HTTP 409" in str(x)}


async def _send_once(
    client: RolloutClient,
    transfer: _Transfer,
    tensors: dict[str, Any],
    version: str | None,
    pause_mode: str | None,
    bucket_bytes: int,
    timeout: float,
    flatten: bool | None,
) -> dict[str, BaseException]:
    """One attempt over `transfer`'s group. Raises SyncError naming the servers that failed
    before the weights were installed (the others keep their old ones, whole); returns
    those that failed only to resume afterwards (they may hold either version)."""
    servers = transfer.servers
    try:
        await client.pause(pause_mode, servers)
        push = Push(tensors, version, bucket_bytes, timeout, flatten)
        await transfer.steps.send(client, transfer, push)
    except BaseException as e:
        # Every server this sync paused is resumed, one that refused the update included (it
        # answered: it serves on, with its old weights); not one that does not answer, nor
        # one another trainer owns.
        leave = _not_answering(e) | _owned_elsewhere(e)
        await _abandon(client, transfer, skip=leave)
        try:
            await client.resume([a for a in servers if a not in leave])
        except SyncError:
            pass
        raise
    try:
        await client.resume(servers)
    except SyncError as e:
        return dict(e.failed)
    return {}


async def _abandon(
    client: RolloutClient, transfer: _Transfer, skip: set[str] = frozenset()
) -> None:
    """After a failed sync: drop the group on both ends and close the servers' sessions, so
    the survivors keep their old weights and the next sync starts a new group. Best effort
    and quick: a server that does not answer within seconds is one the next sync skips;
    those in `skip`, and those cooling down after a failure, are not asked."""
    transfer.close()
    if _TRANSFERS.get(client) is transfer:
        del _TRANSFERS[client]
    now = time.monotonic()
    skip = set(skip) | {s.addr for s in client.pool if s.down_until > now}

    async def quietly(s: Any) -> None:
        try:
            await transfer.steps.drop(client, s, transfer)
        except Exception:  # already down, or the session is already closed
            pass

    await asyncio.gather(*(quietly(client.server(a)) for a in transfer.servers if a not in skip))


def _cast(state: dict[str, Any], dtype: Any) -> dict[str, Any]:
    import torch

    if dtype is None:
        return state
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}


async def _ensure_transfer(
    client: RolloutClient, timeout: float, exclude: set[str] = frozenset()
) -> _Transfer:
    """The client's group, made now if there is none or the reachable servers changed."""
    await client.refresh()  # a restarted server is back: this sync realigns it
    candidates = [s.addr for s in client.reachable() if s.addr not in exclude]
    if not candidates:
        raise client.no_server_error("weight sync")
    old = _TRANSFERS.get(client)
    infos: dict[str, dict] = {}
    # A server restarted at the same address is known by its new instance id, so a server
    # that reported one is asked again at every sync. One that reports none (SGLang, vLLM)
    # is not, while the group stands: the GET would tell nothing, and SGLang's /server_info
    # asks every scheduler for its state (srt/entrypoints/http_server.py:863-892), its
    # slowest control answer (20-45 ms on a CPU, more than the rest of a tiny model's
    # sync). A restarted SGLang is told by its answer for a group it does not know
    # (`lost_group`), a dead server by its failed pause; either way the next round builds
    # a new group, and asks.
    silent: list[str] = []
    if old is not None and old.group is not None and old.servers == candidates:
        silent = [a for a in candidates if old.instances.get(a) is None]
    await _ask_info(client, [a for a in candidates if a not in silent], infos)
    if old is not None:
        restarted = [a for a in infos if a in old.instances
                     and infos[a].get("instance_id") != old.instances[a]]  # fmt: skip
        for a in restarted:
            _restarted(client, a, "it reports another server instance")
        answered = [a for a in candidates if a in infos or a in silent]
        if old.group is not None and old.servers == answered and not restarted:
            return old
    await _ask_info(client, silent, infos)  # a new group: what its servers are (sizes, dtype)
    servers = [a for a in candidates if a in infos]
    if not servers:
        raise client.no_server_error("weight sync")
    if old is not None:
        await _abandon(client, old)
    transfer = await _new_transfer(client, infos, servers, timeout)
    _TRANSFERS[client] = transfer
    return transfer


async def _ask_info(client: RolloutClient, addrs: list[str], infos: dict[str, dict]) -> None:
    """Each server's info into `infos`; a server that does not answer cools down."""

    async def one(a: str) -> None:
        infos[a] = await client.server_info(a)

    results = await asyncio.gather(*(one(a) for a in addrs), return_exceptions=True)
    for addr, r in zip(addrs, results, strict=True):
        if isinstance(r, BaseException):
            client.mark_down(client.server(addr), str(r))


async def _new_transfer(
    client: RolloutClient, infos: dict[str, dict], servers: list[str], timeout: float
) -> _Transfer:
    """A new group of rank 0 and `servers` (rank_offset = 1 + the ranks of the servers
    before), built by the engine's steps."""
    steps = _steps(client)
    sizes = [steps.ranks(infos[a]) for a in servers]
    offsets = [1 + sum(sizes[:i]) for i in range(len(servers))]
    transfer = _Transfer(
        f"areal-weights-{uuid.uuid4().hex[:12]}", servers,
        steps.group_backend(infos, servers), 1 + sum(sizes), steps,
        dtype=_serving_dtype(infos, servers),
        instances={a: infos[a].get("instance_id") for a in servers},
    )  # fmt: skip
    master = _local_address(servers[0])
    with _ports_named():
        ready = steps.prepare(transfer, master, timeout)
    try:
        with _ports_named():
            await steps.join(client, transfer, ready, offsets, timeout)
    except BaseException:
        await _abandon(client, transfer)
        raise
    if transfer.group is None:
        raise RolloutError("weight-update group could not be built")
    return transfer


class _ports_named:
    """Turns the raw EADDRINUSE of the trainer's end of a group (no local port left to
    listen on or connect from) into an error that says what ran out and what to do. A
    server's answer (a RolloutError) passes as it is."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, e: BaseException | None, tb: Any) -> bool:
        if e is None or not isinstance(e, Exception) or isinstance(e, RolloutError):
            return False
        text = str(e)
        if (
            getattr(e, "errno", None) != errno.EADDRINUSE
            and "EADDRINUSE" not in text
            and ("address already in use" not in text.lower())
        ):
            return False
        low, high = _port_range()
        raise RolloutError(
            "weight sync: no local port is free for the weight-update group (EADDRINUSE): "
            f"this host's ephemeral ports ({low}-{high}) are used up",
            hint="close what holds them (`ss -tan | wc -l`; many TIME-WAIT sockets clear "
            "within a minute), widen net.ipv4.ip_local_port_range, or sync with "
            "method='disk', which needs no port",
            detail=text.strip().splitlines()[0] if text.strip() else None,
        ) from e


def _port_range() -> tuple[str, str]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return low, high
    except (OSError, ValueError):
        return "?", "?"


def _serving_dtype(infos: dict[str, dict], servers: list[str]) -> str | None:
    """The dtype every server holds its weights in, when they say so ("auto" says nothing)."""
    found = {str(infos[a].get("dtype")) for a in servers}
    found &= set(_SERVING_DTYPES)
    if len(found) > 1:
        raise UsageError(f"the servers hold different dtypes ({sorted(found)}); pass dtype=")
    return next(iter(found), None)


def _local_address(server_addr: str) -> str:
    """The address of this host that `server_addr` reaches us on (where rank 0 listens)."""
    host = server_addr.rpartition(":")[0].strip("[]")
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))  # no packet is sent: this only picks the route
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())
