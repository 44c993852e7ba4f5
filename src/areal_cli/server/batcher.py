"""The scheduling side of the hf reference server: a request queue and one batch loop.

Requests from every endpoint join one queue; the loop takes up to `max_batch_size` of them
and decodes them together in a worker thread (`engine.Decode`), answering each as it
finishes. The event loop stays free the whole time, so /health answers during generation.

The loop holds `lock` while a batch runs. Weight swaps take the same lock, so new weights
land between steps of no batch, never inside one; each request records which weight
version sampled which of its tokens (SGLang's `weight_versions` spans).

Pausing follows SGLang's three modes (srt/managers/io_struct.py:1927-1946):
    abort     running and queued requests end now with finish_reason "abort"
    retract   the running batch stops at its next step; its requests go back to the front
              of the queue, their output so far kept, and continue after /continue_generation
              from prompt + output (a fresh cache, so under whatever weights are loaded then)
    in_place  the running batch stops at its next step and keeps its cache; it continues
              first after /continue_generation
In every mode new requests wait until /continue_generation.
"""

from __future__ import annotations

import asyncio
import queue
import random
import threading
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from areal_cli.server.engine import Control, Decode, Engine, GenRequest, GenResult
from areal_cli.server.protocol import finish_abort

T = TypeVar("T")


class TorchWorker:
    """One long-lived daemon thread that runs every piece of torch work, in submission order.

    One thread, not one per call: torch's intra-op thread pool belongs to the thread that first
    uses it, and building a fresh pool per request costs more than decoding with a tiny model.
    A daemon thread never holds up shutdown: a SIGTERM during a model load exits at once.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=self._serve, daemon=True, name="torch-worker").start()

    def run(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._jobs.put((loop, fut, fn, args))
        return fut

    def _serve(self) -> None:
        while True:
            loop, fut, fn, args = self._jobs.get()
            try:
                outcome = (True, fn(*args))
            except BaseException as e:  # handed to the awaiting coroutine
                outcome = (False, e)
            try:
                loop.call_soon_threadsafe(_settle, fut, *outcome)
            except RuntimeError:  # the loop closed while this ran: nobody waits any more
                pass


def _settle(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if fut.done():
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


@dataclass
class _Pending:
    req: GenRequest
    fut: asyncio.Future[GenResult]


class Batcher:
    def __init__(
        self,
        engine: Engine,
        worker: TorchWorker,
        *,
        max_batch_size: int = 32,
        batch_window_s: float = 0.005,
        seed: int | None = None,
        weight_version: str = "default",
    ):
        self.engine = engine
        self.worker = worker
        self.max_batch_size = max(1, max_batch_size)
        self.batch_window_s = batch_window_s
        self.seed = seed
        self.weight_version = weight_version
        self.lock = asyncio.Lock()
        self.control = Control()
        self.pause_mode: str | None = None
        self._queue: deque[_Pending] = deque()
        self._arrived = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._running: list[_Pending] = []
        # A batch paused in place: resumed, with its cache, before anything else.
        self._suspended: tuple[Decode, list[_Pending]] | None = None
        self._arrivals = 0
        self._closed = False
        self.requests_served = 0
        self.batches_run = 0
        self.max_batch_size_seen = 0
        self.tokens_generated = 0
        self.retractions = 0
        self.batch_sizes: Counter[int] = Counter()

    # -- requests ---------------------------------------------------------------------------

    def _seed_for(self, explicit: int | None) -> int:
        """A request's sampling seed, fixed at arrival so that, with a server seed, the same
        requests in the same order sample the same tokens however they get batched."""
        self._arrivals += 1
        if explicit is not None:
            return explicit
        if self.seed is None:
            return random.getrandbits(63)
        return (self.seed * 1_000_003 + self._arrivals) % (1 << 63)

    async def submit(self, reqs: list[GenRequest], *, seeded: bool = True) -> list[GenResult]:
        """Queue `reqs` and wait for their results. `seeded=False` keeps each request's own
        seed and leaves the arrival count alone."""
        if seeded:
            for r in reqs:
                r.seed = self._seed_for(r.params.sampling_seed)
        loop = asyncio.get_running_loop()
        pending = [_Pending(r, loop.create_future()) for r in reqs]
        if self._closed:
            return [self._aborted(r) for r in reqs]
        self._queue.extend(pending)
        self._arrived.set()
        try:
            return list(await asyncio.gather(*(p.fut for p in pending)))
        except asyncio.CancelledError:  # the client went away: stop its work
            for p in pending:
                p.fut.cancel()
                self.control.abort_rids.add(p.req.rid)
            raise

    # -- the loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            await self._resumed.wait()
            if self._suspended is not None:
                decode, batch = self._suspended
                self._suspended = None
            else:
                while not self._queue:
                    self._arrived.clear()
                    await self._arrived.wait()
                await self._resumed.wait()
                if len(self._queue) < self.max_batch_size and self.batch_window_s > 0:
                    # Requests fired together arrive a few hundred microseconds apart.
                    await asyncio.sleep(self.batch_window_s)
                if not self._resumed.is_set():
                    continue
                batch = self._take()
                if not batch:
                    continue
                decode = Decode(self.engine, [p.req for p in batch])
                self._record(batch)
            await self._run_segment(decode, batch)

    async def _run_segment(self, decode: Decode, batch: list[_Pending]) -> None:
        async with self.lock:
            version = self.weight_version
            starts = [len(p.req.output_ids) for p in batch]
            self._running = batch
            try:
                done = await self.worker.run(decode.run, self.control)
            except Exception as e:
                for p in batch:
                    if not p.fut.done():
                        p.fut.set_exception(e)
                return
            finally:
                self._running = []
        for p, start in zip(batch, starts, strict=True):
            p.req.record_span(version, start)
        self._answer_finished(decode, batch)
        if done:
            return
        # Suspended by a pause (the abort mode never suspends: rows end as aborted).
        if self.pause_mode == "in_place":
            self._suspended = (decode, batch)
            return
        retracted = {id(r) for r in decode.retract()}
        again = [p for p in batch if id(p.req) in retracted and not p.fut.done()]
        self.retractions += len(again)
        self._queue.extendleft(reversed(again))

    def _answer_finished(self, decode: Decode, batch: list[_Pending]) -> None:
        for i in decode.finished_indices():
            result = decode.take(i)
            p = batch[i]
            self.requests_served += 1
            self.tokens_generated += len(result.output_ids)
            self.control.abort_rids.discard(p.req.rid)
            if not p.fut.done():
                p.fut.set_result(result)

    def _take(self) -> list[_Pending]:
        batch: list[_Pending] = []
        while self._queue and len(batch) < self.max_batch_size:
            p = self._queue.popleft()
            if not p.fut.done():
                batch.append(p)
            else:
                self.control.abort_rids.discard(p.req.rid)
        return batch

    def _record(self, batch: list[_Pending]) -> None:
        self.batches_run += 1
        self.max_batch_size_seen = max(self.max_batch_size_seen, len(batch))
        self.batch_sizes[len(batch)] += 1

    # -- control ----------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    async def pause(self, mode: str) -> None:
        """SGLang's /pause_generation: see the module docstring for the modes."""
        self.pause_mode = mode
        self._resumed.clear()
        if mode == "abort":
            await self.abort_all()
            return
        self.control.suspend.set()
        async with self.lock:  # the running batch has stopped at its next step
            pass

    def resume(self) -> None:
        self.pause_mode = None
        self.control.suspend.clear()
        self._resumed.set()

    @property
    def busy(self) -> bool:
        """A batch is being decoded right now."""
        return bool(self._running)

    @property
    def holds_cache(self) -> bool:
        """A batch paused in place keeps a cache built with the weights it started with."""
        return self._suspended is not None

    def idle(self) -> bool:
        """Nothing holds a cache built with the current weights: SGLang's is_fully_idle with
        waiting requests ignored while paused (scheduler.py:5520)."""
        return self._suspended is None and not self._running and (self.paused or not self._queue)

    async def abort_all(self) -> int:
        """Answer every queued and suspended request as aborted and end the running batch at
        its next step. Returns how many requests were cut short."""
        self.control.abort.set()
        try:
            aborted = self._drain() + len(self._running)
            if self._suspended is not None:
                decode, batch = self._suspended
                self._suspended = None
                aborted += await self._abort_decode(decode, batch)
            async with self.lock:  # the running batch has seen the flag and ended
                pass
            return aborted
        finally:
            if not self._closed:
                self.control.abort.clear()

    async def abort(self, rid: str) -> None:
        """/abort_request for one request id: queued, suspended or running."""
        for p in list(self._queue):
            if p.req.rid == rid and not p.fut.done():
                self._queue.remove(p)
                p.fut.set_result(self._aborted(p.req))
        if self._suspended is not None:
            decode, batch = self._suspended
            for p in batch:
                if p.req.rid == rid and p.req.finished is None:
                    p.req.finished = finish_abort()
            self._answer_finished(decode, batch)
        if self._running:
            self.control.abort_rids.add(rid)

    async def _abort_decode(self, decode: Decode, batch: list[_Pending]) -> int:
        for p in batch:
            if p.req.finished is None:
                p.req.finished = finish_abort()
        n = len(decode.finished_indices())
        self._answer_finished(decode, batch)
        return n

    async def close(self) -> None:
        """Shutdown: abort everything, now and from here on."""
        self._closed = True
        self.resume()  # requests held by a pause get their abort answer too
        await self.abort_all()

    def _drain(self) -> int:
        n = 0
        while self._queue:
            p = self._queue.popleft()
            if not p.fut.done():
                p.fut.set_result(self._aborted(p.req))
                n += 1
        return n

    def _aborted(self, req: GenRequest) -> GenResult:
        req.finished = finish_abort()
        req.record_span(self.weight_version, len(req.output_ids))
        return GenResult(
            output_ids=req.output_ids,
            logprobs=req.logprobs,
            top_logprobs=req.top_logprobs,
            finish_reason=req.finished,
            text=self.engine.decode(req.output_ids) if req.output_ids else "",
            prompt_tokens=len(req.input_ids),
            retractions=req.retractions,
            spans=req.spans,
        )

    async def swap_weights(self, state: dict[str, Any], path: str | None, version: str | None):
        async with self.lock:
            await self.worker.run(self.engine.swap_weights, state, path)
            if version is not None:
                self.weight_version = version

    async def adopt_weights(self, state: dict[str, Any], version: str | None) -> dict[str, Any]:
        """`Engine.adopt_weights` between batches; returns the replaced tensors."""
        async with self.lock:
            old = await self.worker.run(self.engine.adopt_weights, state)
            if version is not None:
                self.weight_version = version
            return old

    def stats(self) -> dict[str, Any]:
        return {
            "requests_served": self.requests_served,
            "batches_run": self.batches_run,
            "max_batch_size_seen": self.max_batch_size_seen,
            "max_batch_size": self.max_batch_size,
            "batch_size_histogram": {str(k): v for k, v in sorted(self.batch_sizes.items())},
            "tokens_generated": self.tokens_generated,
            "retractions": self.retractions,
            "queued": len(self._queue),
            "running": len(self._running),
            "paused": self.paused,
            "pause_mode": self.pause_mode,
        }
