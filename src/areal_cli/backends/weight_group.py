"""The weight-update process group: rank 0 is the trainer, ranks 1.. are the servers' TP ranks.

SGLang builds it with torch's private group helper (srt/utils/common.py:2859-2927,
`init_custom_process_group`): a TCPStore rendezvous at tcp://master_address:master_port, the
store wrapped in PrefixStore(group_name), and inside the helper
(torch/distributed/distributed_c10d.py, `_new_process_group_helper`) in
PrefixStore(f"{group_name}/") and then PrefixStore(f"{device}/"), where device is "cpu" for
gloo and "cuda" for nccl. A group built with public APIs must use the same prefixes or its
rendezvous waits forever for keys nobody writes. Both ends here (the hf server and the
trainer) build it this way, so either can face SGLang.

A bucket in SGLang's `flattened_bucket` format (srt/weight_sync/tensor_bucket.py) is the
tensors' bytes back to back in one uint8 tensor, in request order, each starting at an
offset aligned to its dtype's item size.
"""

from __future__ import annotations

import datetime
import threading
from dataclasses import dataclass
from typing import Any

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def nbytes(self) -> int:
        return self.numel * torch_dtype(self.dtype).itemsize


def torch_dtype(name: str) -> Any:
    """`getattr(torch, name)` as SGLang does it, restricted to real dtypes."""
    import torch

    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"module 'torch' has no dtype {name!r}")
    return dtype


def bucket_layout(metas: list[TensorMeta]) -> list[tuple[int, int]]:
    """(start, end) byte offsets of each tensor in a flattened bucket (tensor_bucket.py:99-125)."""
    out, offset = [], 0
    for m in metas:
        if any(d < 0 for d in m.shape):
            raise ValueError(f"Negative dimension in received tensor {m.name}: {list(m.shape)}")
        itemsize = torch_dtype(m.dtype).itemsize
        if offset % itemsize:
            raise ValueError(
                f"Unaligned received tensor {m.name}: byte offset {offset}, dtype {m.dtype}"
            )
        size = m.numel * itemsize
        out.append((offset, offset + size))
        offset += size
    if not out:
        raise ValueError("Cannot create empty tensor bucket")
    return out


def flatten(tensors: list[Any]) -> Any:
    """One uint8 tensor holding `tensors` back to back (the sender's side of a bucket)."""
    import torch

    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unflatten(bucket: Any, metas: list[TensorMeta]) -> dict[str, Any]:
    """Views into `bucket`, one per tensor (the receiver's side)."""
    return {
        m.name: bucket[a:b].view(torch_dtype(m.dtype)).reshape(m.shape)
        for m, (a, b) in zip(metas, bucket_layout(metas), strict=True)
    }


class Group:
    """One rank's membership of a weight-update group; `broadcast` is its only collective."""

    def __init__(self, backend: Any, store: Any, backend_name: str, rank: int, world_size: int):
        self._backend = backend
        self._store = store  # the TCPStore must live as long as the group
        self.backend = backend_name
        self.rank = rank
        self.world_size = world_size

    @property
    def device(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"

    def broadcast(self, tensor: Any, timeout_s: float | None = None) -> None:
        """Rank 0 sends `tensor`; every other rank receives into it. Blocks until done."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        if timeout_s is not None:
            opts.timeout = datetime.timedelta(seconds=timeout_s)
        self._backend.broadcast([tensor], opts).wait()

    def broadcast_all(self, tensors: list[Any], timeout_s: float | None = None) -> None:
        """`broadcast` of each tensor in order, all posted at once so that the backend's
        worker threads overlap them; returns when every one is done."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        if timeout_s is not None:
            opts.timeout = datetime.timedelta(seconds=timeout_s)
        works = [self._backend.broadcast([t], opts) for t in tensors]
        for work in works:
            work.wait()

    def close(self) -> None:
        """Release the group's connections (peers blocked on it then fail, not hang)."""
        backend, self._backend = self._backend, None
        if backend is None:
            return
        for method in ("abort", "shutdown"):
            try:
                getattr(backend, method)()
                break
            except Exception:  # already broken, or not supported by this backend
                continue
        self._store = None


def close_soon(group: Any, wait_s: float) -> None:
    """`group.close()` in a thread of its own, waited for at most `wait_s`. Gloo's abort
    waits for a collective blocked on a hung peer (up to the group's timeout); the caller,
    an event loop among them, must not wait with it."""

    def close() -> None:
        try:
            group.close()
        except Exception:  # a broken group is being dropped anyway
            pass

    t = threading.Thread(target=close, daemon=True, name="weight-group-close")
    t.start()
    t.join(wait_s)


def join(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
    store: Any = None,
) -> Group:
    """Join (rank > 0) or open (rank 0) the group; blocks until every rank has joined.

    Rank 0 may pass the TCPStore it already listens on (see `listen`), so the port exists
    before the servers are told about it.
    """
    import torch.distributed as dist

    if backend not in BACKENDS:
        raise ValueError(f"unsupported backend {backend!r}; use one of {', '.join(BACKENDS)}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(
            master_address,
            master_port,
            world_size,
            is_master=rank == 0,
            timeout=timeout,
            # A worker's store checks in with the master (it counts the clients that
            # joined): torch's tcp:// rendezvous, which SGLang's helper and the trainers
            # built on it use, waits for every worker. A master opened by `listen` does not
            # wait, so checking in costs nothing there.
            wait_for_workers=rank != 0,
            multi_tenant=True,
        )
    device = "cuda" if backend == "nccl" else "cpu"
    prefixed = dist.PrefixStore(
        f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    )
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.is_high_priority_stream = False
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    return Group(pg, store, backend, rank, world_size)


def listen(host: str, world_size: int, timeout_s: float) -> Any:
    """Rank 0's rendezvous store on a free port (`.port`), not yet waiting for anyone."""
    import torch.distributed as dist

    return dist.TCPStore(
        host,
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        multi_tenant=True,
    )
