"""The weight-sync steps an engine owns, behind one interface the trainer's sync calls.

`worker/weights.py` orchestrates a distributed sync the same way for every engine: which
servers, their ranks in one group, a pause around the update, retries without the servers
that failed, versions. What goes over the wire to build the group, move the tensors and drop
the group is the engine's: its protocol module names its steps in `WEIGHT_SYNC` (the dotted
path of a module whose `STEPS` is a `WeightSync`), and `steps_for(protocol)` finds them.

The steps speak to servers only through the rollout client they are given (worker/rollout.py:
`control`, `on_servers`, `send`, `reuses_weight_metadata`), so nothing here imports the
worker. A `transfer` is the sync's record of one group: `name`, `servers`, `world_size`,
`backend`, `group` (set by `join`), `sent_meta`.
"""

from __future__ import annotations

import asyncio
import importlib
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

# After a broken collective, how long to wait for the HTTP error that names the server.
HTTP_GRACE_S = 3.0


@dataclass
class Push:
    """What one sync sends: the tensors by name, their version, and how (`bucket_bytes` per
    bucket, `flatten` as sync_weights says, `timeout` for each broadcast)."""

    tensors: dict[str, Any]
    version: str | None
    bucket_bytes: int
    timeout: float
    flatten: bool | None


class WeightSync:
    """One engine's steps of a distributed weight sync (rank 0 of the group is the trainer)."""

    # Whether the weights move over a transfer engine of the server's own (one rank per worker
    # of its world), not over a torch.distributed group the servers join.
    native = False

    def ranks(self, info: dict) -> int:
        """How many ranks of the group one server holds, from its server info."""
        raise NotImplementedError

    def group_backend(self, infos: dict[str, dict], servers: list[str]) -> str:
        """The collective backend of the group ("nccl" or "gloo")."""
        raise NotImplementedError

    def prepare(self, transfer: Any, master: str, timeout: float) -> Any:
        """What rank 0 sets up locally before any server is asked (a port to meet at)."""
        raise NotImplementedError

    async def join(
        self, client: Any, transfer: Any, ready: Any, offsets: list[int], timeout: float
    ) -> None:
        """Ask every server to join the group while rank 0 joins it; sets `transfer.group`."""
        raise NotImplementedError

    async def send(self, client: Any, transfer: Any, push: Push) -> None:
        """Move `push.tensors` to every server of the group and label them `push.version`."""
        raise NotImplementedError

    async def drop(self, client: Any, server: Any, transfer: Any) -> None:
        """After a failed sync: drop the group on `server` (and close what the sync opened)."""
        raise NotImplementedError

    def destroy_request(self, transfer: Any) -> tuple[str, dict]:
        """(path, body) that drops the group on a server when the trainer finishes."""
        raise NotImplementedError

    def lost_group(self, error: BaseException) -> bool:
        """Whether a server's answer says it does not know the group (it was restarted)."""
        return False


def steps_for(protocol: ModuleType) -> WeightSync:
    """The weight-sync steps of the engine that speaks `protocol`."""
    return importlib.import_module(protocol.WEIGHT_SYNC).STEPS


def in_thread(fn: Any, *args: Any) -> asyncio.Future:
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


async def together(http: Any, transfer_fn: Any, *args: Any) -> Any:
    """The servers' HTTP requests and rank 0's side of the same collective, at once; the
    first failure of either is raised without waiting for the other (which may hang)."""
    request = asyncio.ensure_future(http)
    collective = in_thread(transfer_fn, *args)
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


async def join_group(
    client: Any, transfer: Any, path: str, body: Any, rank0: Any, timeout: float
) -> None:
    """POST `path` with `body(addr)` to every server of the group (each joins it) while
    rank 0 joins it with `rank0()`: a rendezvous needs both sides at once."""
    http = client.on_servers(
        transfer.servers, path.lstrip("/"),
        lambda s: client.control(s, path, body(s.addr), timeout=timeout + 30),
    )  # fmt: skip
    await together(http, rank0)


def dtype_name(t: Any) -> str:
    """A tensor's dtype as the engines name it: "bfloat16", not "torch.bfloat16"."""
    return str(t.dtype).removeprefix("torch.")
