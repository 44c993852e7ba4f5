"""SGLang's steps of a distributed weight sync, which areal's `hf` server takes too.

The servers' TP ranks join a torch.distributed group with the trainer as rank 0
(/init_weights_update_group, `weight_group`); each bucket is one
/update_weights_from_distributed per server while rank 0 broadcasts it, inside
/begin_weight_update ... /end_weight_update (the hf server's session; SGLang answers 404 to
those, which the sync tolerates where it may); /destroy_weights_update_group drops the group.
"""

from __future__ import annotations

from typing import Any

from areal_cli.backends import protocol_sglang as proto
from areal_cli.backends import weight_group
from areal_cli.backends.weight_sync import (
    Push,
    WeightSync,
    dtype_name,
    join_group,
    together,
)
from areal_cli.errors import LaunchError, UsageError

# Over gloo every broadcast costs about 0.3 ms of its own, and a flattened bucket costs the
# sender a copy and goes down one connection. Measured here (two processes, loopback, load
# 3.6): 27 tensors of 4 KB one by one 8.5 ms, flattened 0.5 ms; 30 of 256 KB 8.1 against
# 7.2 ms; 30 of 1 MB 15 against 45 ms; 195 tensors, 400 MB: 0.4 against 0.9 s. Below this
# size a tensor travels in the flattened bucket of the small ones.
SMALL_TENSOR_BYTES = 256 << 10


class SglangWeightSync(WeightSync):
    native = False

    def ranks(self, info: dict) -> int:
        if int(info.get("dp_size") or 1) != 1:
            # SGLang asserts it (srt/managers/tokenizer_control_mixin.py:451-453).
            raise UsageError("a distributed weight update needs servers with dp_size 1")
        return int(info.get("tp_size") or 1) * int(info.get("pp_size") or 1)

    def group_backend(self, infos: dict[str, dict], servers: list[str]) -> str:
        """nccl when this trainer and every server are on GPUs, gloo otherwise (SGLang passes
        the string to torch unchecked; AReaL's CPU platform sends gloo)."""
        import torch

        on_gpu = all(str(infos[a].get("device", "cuda")).startswith("cuda") for a in servers)
        return "nccl" if on_gpu and torch.cuda.is_available() else "gloo"

    def prepare(self, transfer: Any, master: str, timeout: float) -> Any:
        return master, weight_group.listen(master, transfer.world_size, timeout)

    async def join(
        self, client: Any, transfer: Any, ready: Any, offsets: list[int], timeout: float
    ) -> None:
        master, store = ready
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

        def rank0() -> None:
            transfer.group = weight_group.join(
                master_address=master, master_port=port, rank=0, world_size=transfer.world_size,
                group_name=transfer.name, backend=transfer.backend, timeout_s=timeout,
                store=store,
            )  # fmt: skip

        await join_group(client, transfer, proto.INIT_GROUP_PATH, body, rank0, timeout)

    async def send(self, client: Any, transfer: Any, push: Push) -> None:
        """Each bucket: one /update_weights_from_distributed per server and rank 0's
        broadcast, at once. Over nccl a bucket goes as one `flattened_bucket` (few large
        collectives). Over gloo (`plan`) the small tensors go together as one
        `flattened_bucket` and the large ones tensor by tensor, which spares the sender a copy
        of the whole model and lets a server receive straight into the tensors it will serve."""
        servers, version, timeout = transfer.servers, push.version, push.timeout
        http_timeout = timeout + 30
        await _begin(client, servers)
        buckets = plan(push.tensors, push.bucket_bytes, transfer.backend, push.flatten)
        for i, (bucket, flat) in enumerate(buckets):
            last = i == len(buckets) - 1
            payload = {
                "names": [n for n, _ in bucket],
                "dtypes": [dtype_name(t) for _, t in bucket],
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
                    s, proto.UPDATE_DISTRIBUTED_PATH, p, timeout=http_timeout
                ),
            )  # fmt: skip
            await together(http, broadcast_bucket, transfer, [t for _, t in bucket], flat, timeout)
        await client.on_servers(servers, "end_weight_update",
                                lambda s: client.control(s, proto.END_UPDATE_PATH, {}))  # fmt: skip

    async def drop(self, client: Any, server: Any, transfer: Any) -> None:
        await client.send(server, "POST", proto.DESTROY_GROUP_PATH,
                          {"group_name": transfer.name}, 10)  # fmt: skip
        await client.send(server, "POST", proto.END_UPDATE_PATH, {}, 10)

    def destroy_request(self, transfer: Any) -> tuple[str, dict]:
        return proto.DESTROY_GROUP_PATH, {"group_name": transfer.name}

    def lost_group(self, error: BaseException) -> bool:
        # SGLang's answer for a group it does not have (weight_updater.py), which the hf
        # server gives too.
        text = str(getattr(error, "detail", None) or "") + str(error)
        return "init_weights_update_group` first" in text


STEPS = SglangWeightSync()


def plan(
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
        nbytes = _nbytes(t)
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def broadcast_bucket(transfer: Any, tensors: list[Any], flatten: bool, timeout: float):
    """Rank 0's side of one bucket (a benchmark times it by replacing it here)."""
    if flatten:
        tensors = [weight_group.flatten(tensors)]
    on_gpu = transfer.backend == "nccl"
    transfer.group.broadcast_all(
        [t.contiguous().cuda() if on_gpu else t.contiguous() for t in tensors], timeout
    )


async def _begin(client: Any, servers: list[str]) -> None:
    """/begin_weight_update everywhere. A session left open by a trainer that died mid-sync
    is closed first (its partial update is discarded by the hf server; SGLang keeps what
    it loaded, which this sync overwrites whole)."""

    async def one(s: Any) -> None:
        try:
            await client.control(s, proto.BEGIN_UPDATE_PATH, {})
        except LaunchError as e:  # the server answered (the client's errors are LaunchErrors)
            if "already open" not in str(getattr(e, "detail", None) or ""):
                raise
            await client.control(s, proto.END_UPDATE_PATH, {})
            await client.control(s, proto.BEGIN_UPDATE_PATH, {})

    await client.on_servers(servers, "begin_weight_update", one)
