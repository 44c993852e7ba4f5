"""The scheduling side of the hf reference server: a request queue and one batch loop.

Requests from every endpoint join one queue; the loop takes up to `max_batch_size` of them,
decodes them together in a worker thread, and answers each. The event loop stays free the whole
time, so /health answers during generation.

The loop holds `lock` while a batch runs. Weight swaps take the same lock, so new weights land
between batches, never inside one. Pausing stops the loop from taking new batches (queued and
new requests wait; the running batch finishes). Aborting ends the running batch at its next
step and answers every queued request with finish_reason "abort".
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

from areal_cli.server.engine import Engine, GenRequest, GenResult

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
    ):
        self.engine = engine
        self.worker = worker
        self.max_batch_size = max(1, max_batch_size)
        self.batch_window_s = batch_window_s
        self.seed = seed
        self.weight_version = "0"
        self.lock = asyncio.Lock()
        self.abort = threading.Event()
        self._queue: deque[_Pending] = deque()
        self._arrived = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._arrivals = 0
        self._running = 0
        self._closed = False
        self.requests_served = 0
        self.batches_run = 0
        self.max_batch_size_seen = 0
        self.tokens_generated = 0
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
                r.seed = self._seed_for(r.params.seed)
        loop = asyncio.get_running_loop()
        pending = [_Pending(r, loop.create_future()) for r in reqs]
        if self._closed:
            return [_aborted(r, self.weight_version) for r in reqs]
        self._queue.extend(pending)
        self._arrived.set()
        try:
            return list(await asyncio.gather(*(p.fut for p in pending)))
        except asyncio.CancelledError:  # the client went away: drop what has not started
            for p in pending:
                p.fut.cancel()
            raise

    # -- the loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            while not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
            await self._resumed.wait()
            if len(self._queue) < self.max_batch_size and self.batch_window_s > 0:
                # Requests fired together arrive a few hundred microseconds apart.
                await asyncio.sleep(self.batch_window_s)
            batch = self._take()
            if not batch:
                continue
            async with self.lock:
                version = self.weight_version
                self._running = len(batch)
                try:
                    results = await self.worker.run(
                        self.engine.generate, [p.req for p in batch], self.abort
                    )
                except Exception as e:
                    for p in batch:
                        if not p.fut.done():
                            p.fut.set_exception(e)
                    continue
                finally:
                    self._running = 0
            self._record(batch, results)
            for p, r in zip(batch, results, strict=True):
                r.weight_version = version
                if not p.fut.done():
                    p.fut.set_result(r)

    def _take(self) -> list[_Pending]:
        batch: list[_Pending] = []
        while self._queue and len(batch) < self.max_batch_size:
            p = self._queue.popleft()
            if not p.fut.done():
                batch.append(p)
        return batch

    def _record(self, batch: list[_Pending], results: list[GenResult]) -> None:
        self.batches_run += 1
        self.requests_served += len(batch)
        self.max_batch_size_seen = max(self.max_batch_size_seen, len(batch))
        self.batch_sizes[len(batch)] += 1
        self.tokens_generated += sum(len(r.output_ids) for r in results)

    # -- control ----------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    def pause(self) -> None:
        self._resumed.clear()

    def resume(self) -> None:
        self._resumed.set()

    async def abort_all(self) -> int:
        """Answer every queued request as aborted and end the running batch at its next step.
        Returns how many requests were cut short."""
        self.abort.set()
        try:
            aborted = self._drain() + self._running
            async with self.lock:  # the running batch has seen the flag and ended
                pass
            return aborted
        finally:
            if not self._closed:
                self.abort.clear()

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
                p.fut.set_result(_aborted(p.req, self.weight_version))
                n += 1
        return n

    async def swap_weights(self, state: dict[str, Any], path: str, version: str) -> None:
        async with self.lock:
            await self.worker.run(self.engine.swap_weights, state, path)
            self.weight_version = version

    def stats(self) -> dict[str, Any]:
        return {
            "requests_served": self.requests_served,
            "batches_run": self.batches_run,
            "max_batch_size_seen": self.max_batch_size_seen,
            "max_batch_size": self.max_batch_size,
            "batch_size_histogram": {str(k): v for k, v in sorted(self.batch_sizes.items())},
            "tokens_generated": self.tokens_generated,
            "queued": len(self._queue),
            "running": self._running,
            "paused": self.paused,
        }


def _aborted(req: GenRequest, version: str) -> GenResult:
    return GenResult(
        output_ids=[],
        logprobs=[],
        top_logprobs=[],
        finish_reason={"type": "abort", "message": "aborted before it started"},
        text="",
        prompt_tokens=len(req.input_ids),
        weight_version=version,
    )
