"""Weight sync: gather the sharded model on rank 0, then get it to every inference server.

Two methods, as AReaL and slime have them:

    distributed  rank 0 joins a process group with every server's TP ranks (rank_offset =
                 1 + sum of tp*pp of the servers before) and broadcasts the full state dict
                 in buckets, while the HTTP requests that make the servers receive them run
                 in the background; SGLang's /init_weights_update_group and
                 /update_weights_from_distributed (load_format flattened_bucket) inside
                 /begin_weight_update ... /end_weight_update, or vLLM's native weight
                 transfer. The group is made once per client and reused; when a server
                 fails or the set of servers changes, the next sync builds a new one.
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

from areal_cli.backends import protocol_sglang as _sglang
from areal_cli.backends import protocol_vllm as _vllm
from areal_cli.errors import UsageError
from areal_cli.worker.channel import report_progress

if TYPE_CHECKING:
    import torch

    from areal_cli.worker.rollout import RolloutClient

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
# After a broken collective, how long to wait for the HTTP error that names the server.
HTTP_GRACE_S = 3.0
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
    import torch.distributed as dist

    method = method or ("disk" if path is not None else "distributed")
    if method not in METHODS:
        raise UsageError(f"unknown weight sync method {method!r}", hint="use distributed or disk")
    if method == "disk" and path is None:
        raise UsageError("sync_weights(method='disk') needs a path for the checkpoint")
    v = None if version is None else str(version)

    t0 = time.perf_counter()
    result: list[Any] = [None]
    error: Exception | None = None
    if method == "disk":
        target = save_hf_checkpoint(model, path, tokenizer_from=tokenizer_from, dtype=dtype)
        t1 = time.perf_counter()
        if _rank() == 0:
            try:
                got = client.run(_reload(client, target, v, pause_mode))
                result[0] = {"ok": True, **got, "bytes": _dir_bytes(target)}
            except Exception as e:  # every rank must learn of it, or the others hang
                error = e
                result[0] = {"ok": False, "message": getattr(e, "message", None) or str(e)}
        stats = {"save_s": t1 - t0}
    else:
        state = full_state_dict(model)
        t1 = time.perf_counter()
        if _rank() == 0:
            try:
                if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
                    state.pop("lm_head.weight", None)  # the servers tie it themselves
                sent = client.run(
                    _send(client, state, v, dtype, pause_mode, bucket_bytes, timeout, flatten)
                )
                result[0] = {"ok": True, **sent}
            except Exception as e:
                error = e
                result[0] = {"ok": False, "message": getattr(e, "message", None) or str(e)}
        stats = {"gather_s": t1 - t0}
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(result, src=0)
    outcome = result[0]
    if error is not None:
        raise error
    if not outcome["ok"]:
        from areal_cli.worker.rollout import RolloutError

        raise RolloutError(f"weight sync failed on rank 0: {outcome['message']}")
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


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


async def _reload(
    client: RolloutClient, path: Path, version: str | None, pause_mode: str | None
) -> dict[str, Any]:
    _SYNCED.add(client)
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
    """One weight-update group: this process is rank 0, `servers` hold ranks 1..world-1."""

    name: str
    servers: list[str]
    backend: str
    world_size: int
    group: Any = None  # weight_group.Group, or vLLM's communicator
    native: bool = False  # over the servers' own transfer engine (vLLM's), not a torch group
    dtype: str | None = None  # what the servers hold their weights in, when they say
    sent_meta: Any = None  # vLLM: the metadata its servers already hold
    # Each server's instance id when the group was made: another one at the same address
    # is a restarted server, which holds neither the group nor our weights.
    instances: dict[str, Any] = field(default_factory=dict)

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Drop the group. Gloo's abort waits for a broadcast blocked on a hung peer (up to
        the group's timeout), so the teardown runs in a thread of its own and is waited for
        only `wait_s`: the sync goes on with the other servers meanwhile."""
        from areal_cli.server import weight_group

        group, self.group = self.group, None
        if group is not None:
            weight_group.close_soon(group, wait_s)


# One group per client, made by the first distributed sync and reused by the next ones.
_TRANSFERS: weakref.WeakKeyDictionary[Any, _Transfer] = weakref.WeakKeyDictionary()
# Clients that synced: at their close (or the interpreter's exit) their group is destroyed
# and the ownership of the servers' weights given up.
_SYNCED: weakref.WeakSet[Any] = weakref.WeakSet()
RELEASE_TIMEOUT_S = 5.0


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
        for addr in transfer.servers:
            if transfer.native:
                destroy.append((addr, _vllm.SHUTDOWN_TRANSFER_PATH, {}))
            else:
                destroy.append((addr, _sglang.DESTROY_GROUP_PATH, {"group_name": transfer.name}))
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


def _in_thread(fn: Any, *args: Any) -> asyncio.Future:
    """Run blocking `fn` in a daemon thread: a broadcast stuck on a dead peer must not hold
    up the interpreter's exit, as asyncio's executor threads would."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def target() -> None:
        try:
            value, ok = fn(*args), True
        except BaseException as e:  # handed to the awaiting coroutine
            value, ok = e, False
        try:
            loop.call_soon_threadsafe(_settle, fut, ok, value)
        except RuntimeError:  # the loop is gone: nobody waits any more
            pass

    threading.Thread(target=target, daemon=True, name="weight-broadcast").start()
    return fut


def _settle(fut: asyncio.Future, ok: bool, value: Any) -> None:
    if not fut.done():
        fut.set_result(value) if ok else fut.set_exception(value)


async def _together(http: Any, transfer_fn: Any, *args: Any) -> Any:
    """The servers' HTTP requests and rank 0's side of the same collective, at once; the
    first failure of either is raised without waiting for the other (which may hang)."""
    request = asyncio.ensure_future(http)
    collective = _in_thread(transfer_fn, *args)
    # A collective abandoned on a failure ends later (its timeout); nobody reads it then.
    collective.add_done_callback(lambda f: f.cancelled() or f.exception())
    done, _ = await asyncio.wait({request, collective}, return_when=asyncio.FIRST_EXCEPTION)
    if request in done and request.exception() is not None:
        raise request.exception()
    if collective in done and collective.exception() is not None:
        # A peer that died breaks the collective at once; its HTTP request fails a moment
        # later and names the server, which the collective's error does not.
        try:
            await asyncio.wait_for(asyncio.shield(request), HTTP_GRACE_S)
        except asyncio.TimeoutError:
            request.cancel()
        if request.done() and not request.cancelled() and request.exception() is not None:
            raise request.exception() from collective.exception()
        raise collective.exception()
    return request.result()


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
    from areal_cli.worker.rollout import SyncError

    failed: dict[str, BaseException] = {}
    rebuilt: set[str] = set()
    _SYNCED.add(client)
    while True:
        try:
            transfer = await _ensure_transfer(client, timeout, exclude=set(failed))
            tensors = _cast(state, dtype or transfer.dtype)
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            late = await _send_once(
                client, transfer, tensors, version, pause_mode, bucket_bytes, timeout, flatten
            )
        except SyncError as e:  # some servers failed: the others keep their old weights
            lost = {a for a, x in e.failed.items() if _lost_group(x)} - rebuilt
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


def _why(e: BaseException) -> str:
    return getattr(e, "message", None) or str(e) or type(e).__name__


def _lost_group(e: BaseException) -> bool:
    # SGLang's answer for a group it does not have (weight_updater.py), which the hf server
    # gives too.
    return "init_weights_update_group` first" in str(getattr(e, "detail", None) or "") + str(e)


def _restarted(client: RolloutClient, addr: str, why: str) -> None:
    log.warning("%s was restarted since the last weight sync (%s): it holds its own weights "
                "again, not the trainer's", addr, why)  # fmt: skip
    server = client.server(addr)
    server.weight_version = None
    server.stale = True  # until a sync reaches it


def _not_answering(e: BaseException) -> set[str]:
    """The servers of a failed step that gave no answer at all (refused, reset, hung):
    asking them anything more now only costs time."""
    from areal_cli.worker.rollout import SyncError, unreachable

    if not isinstance(e, SyncError):
        return set()
    return {a for a, x in e.failed.items() if unreachable(x)}


def _owned_elsewhere(e: BaseException) -> set[str]:
    """The servers that refused a step because another trainer owns their weights: their
    pause, if any, is that trainer's to end."""
    from areal_cli.worker.rollout import SyncError

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
    from areal_cli.worker.rollout import SyncError

    servers = transfer.servers
    try:
        await client.pause(pause_mode, servers)
        if transfer.native:
            await _send_vllm(client, transfer, tensors, version, timeout)
        else:
            await _send_sglang(client, transfer, tensors, version, bucket_bytes, timeout, flatten)
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


async def _send_sglang(
    client: RolloutClient,
    transfer: _Transfer,
    tensors: dict[str, Any],
    version: str | None,
    bucket_bytes: int,
    timeout: float,
    flatten: bool | None,
) -> None:
    """Each bucket: one /update_weights_from_distributed per server and rank 0's broadcast,
    at once. Over nccl a bucket goes as one `flattened_bucket` (few large collectives).
    Over gloo (`_plan`) the small tensors go together as one `flattened_bucket` and the
    large ones tensor by tensor, which spares the sender a copy of the whole model and
    lets a server receive straight into the tensors it will serve."""
    servers = transfer.servers
    http_timeout = timeout + 30
    await _begin(client, servers)
    buckets = _plan(tensors, bucket_bytes, transfer.backend, flatten)
    for i, (bucket, flat) in enumerate(buckets):
        last = i == len(buckets) - 1
        payload = {
            "names": [n for n, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": transfer.name,
            "flush_cache": last,
        }
        if flat:
            payload["load_format"] = "flattened_bucket"
        if last and version is not None:
            payload["weight_version"] = version
        http = client.on_servers(
            servers, "update_weights_from_distributed",
            lambda s, p=payload: client.control(
                s, _sglang.UPDATE_DISTRIBUTED_PATH, p, timeout=http_timeout
            ),
        )  # fmt: skip
        await _together(http, _broadcast_bucket, transfer, [t for _, t in bucket], flat, timeout)
    await client.on_servers(servers, "end_weight_update",
                            lambda s: client.control(s, _sglang.END_UPDATE_PATH, {}))  # fmt: skip


def _broadcast_bucket(transfer: _Transfer, tensors: list[Any], flatten: bool, timeout: float):
    from areal_cli.server import weight_group

    if flatten:
        tensors = [weight_group.flatten(tensors)]
    on_gpu = transfer.backend == "nccl"
    transfer.group.broadcast_all(
        [t.contiguous().cuda() if on_gpu else t.contiguous() for t in tensors], timeout
    )


async def _begin(client: RolloutClient, servers: list[str]) -> None:
    """/begin_weight_update everywhere. A session left open by a trainer that died mid-sync
    is closed first (its partial update is discarded by the hf server; SGLang keeps what
    it loaded, which this sync overwrites whole)."""

    async def one(s: Any) -> None:
        from areal_cli.worker.rollout import RolloutError

        try:
            await client.control(s, _sglang.BEGIN_UPDATE_PATH, {})
        except RolloutError as e:
            if "already open" not in str(e.detail or ""):
                raise
            await client.control(s, _sglang.END_UPDATE_PATH, {})
            await client.control(s, _sglang.BEGIN_UPDATE_PATH, {})

    await client.on_servers(servers, "begin_weight_update", one)


async def _send_vllm(
    client: RolloutClient,
    transfer: _Transfer,
    tensors: dict[str, Any],
    version: str | None,
    timeout: float,
) -> None:
    """vLLM 0.33's native transfer (vllm/entrypoints/rl/online/api_router.py:162-214,
    vllm/distributed/weight_transfer/nccl_engine.py:183-240, unpacked: one broadcast per
    tensor, in the order of the metadata)."""
    servers = transfer.servers
    meta = {
        "names": list(tensors),
        "dtype_names": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
        "shapes": [list(t.shape) for t in tensors.values()],
    }
    # Unchanged metadata is sent once to a vLLM that reuses the last (0.33, nccl_engine.py:
    # 93-96); 0.32 reads empty lists as "nothing to receive", so it gets them every time.
    unchanged = {"names": [], "dtype_names": [], "shapes": []}
    reuse = {a: meta == transfer.sent_meta and await client.reuses_weight_metadata(a)
             for a in servers}  # fmt: skip
    await client.on_servers(servers, "start_weight_update",
                            lambda s: client.control(s, _vllm.START_UPDATE_PATH))  # fmt: skip
    http = client.on_servers(
        servers, "update_weights",
        lambda s: client.control(s, _vllm.UPDATE_PATH,
                                  {"update_info": unchanged if reuse[s.addr] else meta},
                                  timeout=timeout + 30),
    )  # fmt: skip
    await _together(http, transfer.group.send, list(tensors.values()))
    transfer.sent_meta = meta
    body = {} if version is None else {"weight_version": version}
    await client.on_servers(servers, "finish_weight_update",
                            lambda s: client.control(s, _vllm.FINISH_UPDATE_PATH, body))  # fmt: skip


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

    async def one(s: Any) -> None:
        if transfer.native:
            await client.send(s, "POST", _vllm.SHUTDOWN_TRANSFER_PATH, {}, 10)
            return
        await client.send(s, "POST", _sglang.DESTROY_GROUP_PATH,
                              {"group_name": transfer.name}, 10)  # fmt: skip
        await client.send(s, "POST", _sglang.END_UPDATE_PATH, {}, 10)

    async def quietly(s: Any) -> None:
        try:
            await one(s)
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


# Over gloo every broadcast costs about 0.3 ms of its own, and a flattened bucket costs the
# sender a copy and goes down one connection. Measured here (two processes, loopback, load
# 3.6): 27 tensors of 4 KB one by one 8.5 ms, flattened 0.5 ms; 30 of 256 KB 8.1 against
# 7.2 ms; 30 of 1 MB 15 against 45 ms; 195 tensors, 400 MB: 0.4 against 0.9 s. Below this
# size a tensor travels in the flattened bucket of the small ones.
SMALL_TENSOR_BYTES = 256 << 10


def _plan(
    tensors: dict[str, Any], limit: int, backend: str, flatten: bool | None
) -> list[tuple[list[tuple[str, Any]], bool]]:
    """The buckets of one sync, each with whether it goes as one `flattened_bucket`: all of
    them over nccl (by default), or as `flatten` says; over gloo the tensors under
    SMALL_TENSOR_BYTES flattened together first (a tiny model: one broadcast in all), then
    the others tensor by tensor. The order of the names does not matter to the servers:
    SGLang loads each by its name (Qwen2ForCausalLM.load_weights), the hf server installs
    the whole session at its end."""
    if flatten is None and backend == "nccl":
        flatten = True
    if flatten is not None:
        return [(b, flatten) for b in _buckets(_aligned(tensors) if flatten else tensors, limit)]
    small = _aligned({n: t for n, t in tensors.items() if _nbytes(t) < SMALL_TENSOR_BYTES})
    large = {n: t for n, t in tensors.items() if n not in small}
    return [(b, True) for b in _buckets(small, limit)] + [
        (b, False) for b in _buckets(large, limit)
    ]


def _aligned(tensors: dict[str, Any]) -> dict[str, Any]:
    """Widest items first: in a flattened bucket every tensor then starts at a multiple of
    its item size, which SGLang requires (srt/weight_sync/tensor_bucket.py, `empty`)."""
    return dict(sorted(tensors.items(), key=lambda kv: -kv[1].element_size()))


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


def _buckets(tensors: dict[str, Any], limit: int):
    """Consecutive (name, tensor) groups of at most `limit` bytes each (one bigger tensor
    makes a bucket of its own)."""
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


async def _ensure_transfer(
    client: RolloutClient, timeout: float, exclude: set[str] = frozenset()
) -> _Transfer:
    """The client's group, made now if there is none or the reachable servers changed."""
    from areal_cli.worker.rollout import RolloutError

    await client.refresh()  # a restarted server is back: this sync realigns it
    candidates = [s.addr for s in client.reachable() if s.addr not in exclude]
    if not candidates:
        raise client.no_server_error("weight sync")
    old = _TRANSFERS.get(client)
    infos: dict[str, dict] = {}

    async def ask(addrs: list[str]) -> None:
        async def one(a: str) -> None:
            infos[a] = await client.server_info(a)

        results = await asyncio.gather(*(one(a) for a in addrs), return_exceptions=True)
        for addr, r in zip(addrs, results, strict=True):
            if isinstance(r, BaseException):
                client.mark_down(client.server(addr), str(r))

    # A server restarted at the same address is known by its new instance id, so a server
    # that reported one is asked again at every sync. One that reports none (SGLang, vLLM)
    # is not, while the group stands: the GET would tell nothing, and SGLang's /server_info
    # asks every scheduler for its state (srt/entrypoints/http_server.py:863-892), its
    # slowest control answer (20-45 ms on a CPU, more than the rest of a tiny model's
    # sync). A restarted SGLang is told by its answer for a group it does not know
    # (`_lost_group`), a dead server by its failed pause; either way the next round builds
    # a new group, and asks.
    silent: list[str] = []
    if old is not None and old.group is not None and old.servers == candidates:
        silent = [a for a in candidates if old.instances.get(a) is None]
    await ask([a for a in candidates if a not in silent])
    if old is not None:
        restarted = [a for a in infos if a in old.instances
                     and infos[a].get("instance_id") != old.instances[a]]  # fmt: skip
        for a in restarted:
            _restarted(client, a, "it reports another server instance")
        answered = [a for a in candidates if a in infos or a in silent]
        if old.group is not None and old.servers == answered and not restarted:
            return old
    await ask(silent)  # a new group is made: what its servers are (sizes, device, dtype)
    servers = [a for a in candidates if a in infos]
    if not servers:
        raise client.no_server_error("weight sync")
    if old is not None:
        await _abandon(client, old)

    native = client.protocol.NATIVE_WEIGHT_TRANSFER
    sizes = [_ranks(infos[a], native) for a in servers]
    world = 1 + sum(sizes)
    offsets = [1 + sum(sizes[:i]) for i in range(len(servers))]
    backend = _backend(infos, servers, native)
    name = f"areal-weights-{uuid.uuid4().hex[:12]}"
    master = _local_address(servers[0])
    transfer = _Transfer(
        name=name,
        servers=servers,
        backend=backend,
        world_size=world,
        native=native,
        dtype=_serving_dtype(infos, servers),
        instances={a: infos[a].get("instance_id") for a in servers},
    )
    if native:
        await _init_vllm(client, transfer, master, offsets, timeout)
    else:
        await _init_sglang(client, transfer, master, offsets, timeout)
    if transfer.group is None:
        raise RolloutError("weight-update group could not be built")
    _TRANSFERS[client] = transfer
    return transfer


async def _init_sglang(
    client: RolloutClient, transfer: _Transfer, master: str, offsets: list[int], timeout: float
) -> None:
    from areal_cli.server import weight_group

    with _ports_named():
        store = weight_group.listen(master, transfer.world_size, timeout)
    port = store.port

    def body(addr: str) -> dict:
        # InitWeightsUpdateGroupReqInput (sglang/srt/managers/io_struct.py:2126-2138)
        return {
            "master_address": master,
            "master_port": port,
            "rank_offset": offsets[transfer.servers.index(addr)],
            "world_size": transfer.world_size,
            "group_name": transfer.name,
            "backend": transfer.backend,
        }

    http = client.on_servers(
        transfer.servers, "init_weights_update_group",
        lambda s: client.control(s, _sglang.INIT_GROUP_PATH, body(s.addr),
                                  timeout=timeout + 30),
    )  # fmt: skip

    def join() -> Any:
        with _ports_named():
            transfer.group = weight_group.join(
                master_address=master, master_port=port, rank=0, world_size=transfer.world_size,
                group_name=transfer.name, backend=transfer.backend, timeout_s=timeout,
                store=store,
            )  # fmt: skip

    try:
        await _together(http, join)
    except BaseException:
        await _abandon(client, transfer)
        raise


class _ports_named:
    """Turns torch's raw EADDRINUSE (no local port left to listen on or connect from) into
    an error that says what ran out and what to do."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, e: BaseException | None, tb: Any) -> bool:
        if e is None or not isinstance(e, Exception):
            return False
        text = str(e)
        if (
            getattr(e, "errno", None) != errno.EADDRINUSE
            and "EADDRINUSE" not in text
            and ("address already in use" not in text.lower())
        ):
            return False
        from areal_cli.worker.rollout import RolloutError

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


class _VllmGroup:
    """Rank 0 of vLLM's trainer-to-worker NCCL group (its own communicator, not torch's)."""

    def __init__(self, master: str, port: int, world_size: int):
        try:
            from vllm.distributed.weight_transfer.nccl_common import trainer_init
        except ImportError:
            raise UsageError(
                "vLLM's native weight transfer needs the vllm package and a GPU in the trainer",
                hint="install vllm next to the trainer, or sync with method='disk'",
            ) from None
        info = {"master_address": master, "master_port": port, "world_size": world_size}
        self._comm = trainer_init(info)

    def send(self, tensors: list[Any]) -> None:
        import torch

        stream = torch.cuda.current_stream()
        for t in tensors:
            self._comm.broadcast(t.cuda(non_blocking=True), src=0, stream=stream)
        stream.synchronize()

    def close(self) -> None:
        self._comm.destroy()


# Made by `_init_vllm`; a test without GPUs puts a recording group in its place.
VLLM_GROUP: Any = _VllmGroup


async def _init_vllm(
    client: RolloutClient, transfer: _Transfer, master: str, offsets: list[int], timeout: float
) -> None:
    port = _free_port(master)

    def body(addr: str) -> dict:
        # NCCLWeightTransferInitInfo (vllm/distributed/weight_transfer/nccl_common.py:75-107)
        return {"init_info": {
            "master_address": master, "master_port": port, "world_size": transfer.world_size,
            "rank_offset": offsets[transfer.servers.index(addr)], "packed": False,
        }}  # fmt: skip

    http = client.on_servers(
        transfer.servers, "init_weight_transfer_engine",
        lambda s: client.control(s, _vllm.INIT_TRANSFER_PATH, body(s.addr),
                                  timeout=timeout + 30),
    )  # fmt: skip

    def join() -> None:
        transfer.group = VLLM_GROUP(master, port, transfer.world_size)

    try:
        await _together(http, join)
    except BaseException:
        await _abandon(client, transfer)
        raise


def _ranks(info: dict, native: bool) -> int:
    if native:
        return int(info["world_size"])
    if int(info.get("dp_size") or 1) != 1:
        # SGLang asserts it (srt/managers/tokenizer_control_mixin.py:451-453).
        raise UsageError("a distributed weight update needs servers with dp_size 1")
    return int(info.get("tp_size") or 1) * int(info.get("pp_size") or 1)


def _backend(infos: dict[str, dict], servers: list[str], native: bool) -> str:
    """nccl when this trainer and every server are on GPUs, gloo otherwise (SGLang passes
    the string to torch unchecked; AReaL's CPU platform sends gloo)."""
    import torch

    if native:
        return "nccl"
    on_gpu = all(str(infos[a].get("device", "cuda")).startswith("cuda") for a in servers)
    return "nccl" if on_gpu and torch.cuda.is_available() else "gloo"


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


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
