"""vLLM's steps of a distributed weight sync: its native weight transfer.

The trainer is rank 0 of vLLM's own NCCL communicator (not a torch group), one rank per
worker of /get_world_size: /init_weight_transfer_engine, then per sync /start_weight_update,
/update_weights (the metadata) while rank 0 broadcasts every tensor, /finish_weight_update
(the version); /shutdown_weight_transfer_engine drops it (rl/online/api_router.py).
"""

from __future__ import annotations

import socket
from typing import Any

from areal_cli.backends import protocol_vllm as proto
from areal_cli.backends.weight_sync import Push, WeightSync, dtype_name, join_group, together
from areal_cli.errors import UsageError


class VllmGroup:
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


# Made by `join`; a test without GPUs puts a recording group in its place.
VLLM_GROUP: Any = VllmGroup


class VllmWeightSync(WeightSync):
    native = True

    def ranks(self, info: dict) -> int:
        return int(info["world_size"])

    def group_backend(self, infos: dict[str, dict], servers: list[str]) -> str:
        return "nccl"

    def prepare(self, transfer: Any, master: str, timeout: float) -> Any:
        return master, _free_port(master)

    async def join(
        self, client: Any, transfer: Any, ready: Any, offsets: list[int], timeout: float
    ) -> None:
        master, port = ready

        def body(addr: str) -> dict:
            # NCCLWeightTransferInitInfo (vllm/distributed/weight_transfer/nccl_common.py:75-107)
            return {"init_info": {
                "master_address": master, "master_port": port, "world_size": transfer.world_size,
                "rank_offset": offsets[transfer.servers.index(addr)], "packed": False,
            }}  # fmt: skip

        def rank0() -> None:
            transfer.group = VLLM_GROUP(master, port, transfer.world_size)

        await join_group(client, transfer, proto.INIT_TRANSFER_PATH, body, rank0, timeout)

    async def send(self, client: Any, transfer: Any, push: Push) -> None:
        """vLLM 0.33's native transfer (vllm/entrypoints/rl/online/api_router.py:162-214,
        vllm/distributed/weight_transfer/nccl_engine.py:183-240, unpacked: one broadcast per
        tensor, in the order of the metadata); no buckets."""
        servers, tensors, version = transfer.servers, push.tensors, push.version
        timeout = push.timeout
        meta = {
            "names": list(tensors),
            "dtype_names": [dtype_name(t) for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()],
        }
        # Unchanged metadata is sent once to a vLLM that reuses the last (0.33, nccl_engine.py:
        # 93-96); 0.32 reads empty lists as "nothing to receive", so it gets them every time.
        unchanged = {"names": [], "dtype_names": [], "shapes": []}
        reuse = {a: meta == transfer.sent_meta
                 and proto.reuses_metadata(await client.engine_version(a))
                 for a in servers}  # fmt: skip
        await client.on_servers(servers, "start_weight_update",
                                lambda s: client.control(s, proto.START_UPDATE_PATH))  # fmt: skip
        http = client.on_servers(
            servers, "update_weights",
            lambda s: client.control(s, proto.UPDATE_PATH,
                                     {"update_info": unchanged if reuse[s.addr] else meta},
                                     timeout=timeout + 30),
        )  # fmt: skip
        await together(http, transfer.group.send, list(tensors.values()))
        transfer.sent_meta = meta
        body = {} if version is None else {"weight_version": version}
        await client.on_servers(servers, "finish_weight_update",
                                lambda s: client.control(s, proto.FINISH_UPDATE_PATH, body))  # fmt: skip

    async def drop(self, client: Any, server: Any, transfer: Any) -> None:
        await client.send(server, "POST", proto.SHUTDOWN_TRANSFER_PATH, {}, 10)

    def destroy_request(self, transfer: Any) -> tuple[str, dict]:
        return proto.SHUTDOWN_TRANSFER_PATH, {}


STEPS = VllmWeightSync()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
