"""Token-in/token-out generation spread over a pool of inference servers, and their control.

One `RolloutClient` owns one aiohttp session and a view of every server: how many
requests it is serving right now, whether it failed recently, and the weight version it
reported last. A request goes to the live server with the fewest requests in flight; a
server that refuses, resets, times out or answers 5xx is skipped for `cooldown` seconds
(doubling while it keeps failing, up to `max_cooldown`) and the request moves on to another
one. A completion a server aborted (finish_reason "abort", e.g. a pause in abort mode) is
retried, never returned.

A hung server (stopped, deadlocked, swapped out) accepts connections and never answers, and
a long generation legitimately takes minutes, so no single deadline tells them apart. A
request left unanswered for `stall_timeout` seconds makes the client ask the server a cheap
question (GET /model_info, vLLM /v1/models); no reply within `probe_timeout` and the server
counts as hung: the request fails over, a control call fails naming it. So a hung server
costs about stall_timeout + probe_timeout, whatever `timeout` allows a live one. One timer
per client does the watching, only while requests are in flight.

What goes over the wire (routes, bodies, replies, pause modes, versions) is the protocol
module of the engine the servers run (`backends.protocol_for`, backends/protocol.py); this
module never names an engine.

Async code awaits the methods directly; synchronous training loops call
`client.run(client.generate_batch(...))`, which keeps one private event loop alive so
the session and its pooled connections survive between steps.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from areal_cli import backends
from areal_cli.backends import protocol_for
from areal_cli.backends.protocol import INITIAL_VERSION, Completion
from areal_cli.backends.protocol import version_str as _version_str
from areal_cli.backends.protocol import version_tuple as _version_tuple
from areal_cli.errors import LaunchError, UsageError
from areal_cli.registry import open_registry
from areal_cli.server.weight_update import (
    OWNER_HEADER,
    OWNER_NAME_HEADER,
    OWNER_PROCESS_HEADER,
)
from areal_cli.worker.channel import report_progress

T = TypeVar("T")
_log = logging.getLogger("areal.worker")


class RolloutError(LaunchError):
    """Generation or a weight update could not be served by any inference server."""


@dataclass
class _Server:
    addr: str
    in_flight: int = 0
    down_until: float = 0.0
    failures: int = 0  # incidents in a row, for the cooldown's growth
    answered: float = 0.0  # time.monotonic() of its last HTTP answer
    probe: asyncio.Future | None = None  # a liveness question in flight
    # Requests in flight: their task -> (start, path), for the hang watchdog.
    pending: dict = field(default_factory=dict)
    last_error: str | None = None
    weight_version: str | None = None
    # A server whose weight update failed keeps serving old weights: never sample from it
    # again until an update succeeds.
    stale: bool = False
    # It stopped answering (refused, reset): it may have been restarted, with its base
    # weights, so its weight version is asked before it gets another rollout.
    suspect: bool = False
    # Restarted: back at its initial weights while the trainer's moved on. Stale until a
    # sync reaches it (on the ranks that do not sync: until it reports another version).
    reset: bool = False
    # Discovery (the registry): who it listed this server as last (its pid and start), None
    # while never listed; `unlisted` once it left discovery (its runner took it out: it
    # died, or stopped answering) until it is listed again.
    listed: Any = None
    unlisted: bool = False
    model_name: str | None = None  # vLLM needs the served model's name in every request
    # vLLM: its version from GET /version, e.g. (0, 32); None when it did not say.
    engine_version: tuple[int, ...] | None = None
    # vLLM: the one fetch of the facts above that every request waits on (single flight).
    facts: asyncio.Future | None = None

    def live(self, now: float) -> bool:
        return not self.stale and not self.unlisted and self.down_until <= now


ServerState = _Server  # the public name of one server's state in the pool


class _Retryable(Exception):
    """A failure that another server (or the same one later) may not have.

    `cooldown`: the server itself is in trouble (unreachable, reset, timed out, 502-504),
    so it is skipped for a while. A plain 500 or a 429 may be about this one request or
    this one moment; the request moves on but the server stays in rotation.
    """

    def __init__(self, message: str, cooldown: bool = True, status: int | None = None):
        super().__init__(message)
        self.cooldown = cooldown
        self.status = status  # the HTTP status, when the server answered at all


class _NotFound(RolloutError):
    """HTTP 404: the server does not have this route (an older or newer version)."""


def _check_args(
    addrs: list[str], backend: str, max_concurrency: int, stall_timeout: float, **timeouts: float
) -> None:
    """One clear UsageError for a client that could never serve."""
    if not addrs:
        raise UsageError(
            "no inference server addresses given",
            hint="start servers with `areal serve` or set AREAL_LLM_SERVER_ADDRS=host:port,...",
        )
    if backends.find(backend) is None:
        raise UsageError(
            f"unknown server backend {backend!r}",
            hint=f"use one of: {', '.join(backends.names())}",
        )
    if max_concurrency < 1:
        raise UsageError("max_concurrency must be at least 1")
    for name, v in timeouts.items():
        if not v > 0:
            raise UsageError(f"{name} must be a number of seconds > 0, not {v!r}")
    if not stall_timeout >= 0:
        raise UsageError(f"stall_timeout must be >= 0 seconds (0: off), not {stall_timeout!r}")


def _normalise_addr(addr: str) -> str:
    addr = addr.strip().rstrip("/")
    for prefix in ("http://", "https://"):
        if addr.startswith(prefix):
            addr = addr[len(prefix) :]
    return addr


class RolloutClient:
    """Generate from a pool of inference servers; also pause, resume and reload their weights.

    Example (synchronous training loop):

        client = RolloutClient(["127.0.0.1:30000", "127.0.0.1:30001"], backend="sglang")
        groups = client.run(client.generate_batch(prompts, n=8, max_new_tokens=256))
        client.run(client.update_weights_from_disk("/ckpt/step3", version=3))
        client.close_sync()
    """

    def __init__(
        self,
        servers: Iterable[str],
        backend: str = backends.FALLBACK,
        api_key: str | None = None,
        *,
        max_concurrency: int = 128,
        timeout: float = 600.0,
        retries: int = 3,
        cooldown: float = 5.0,
        retry_backoff: float = 0.2,
        control_timeout: float = 600.0,
        stall_timeout: float = 10.0,
        probe_timeout: float = 5.0,
        max_cooldown: float = 60.0,
        discover: Callable[[], dict[str, Any]] | None = None,
        discover_every: float = 1.0,
    ):
        """`timeout`: seconds one generation request may take; `control_timeout`: one
        control call (pause, weight update, ...); `stall_timeout` and `probe_timeout`: how
        soon a server that stopped answering counts as hung (0 turns the check off);
        `cooldown`: how long a failed server is skipped at first, doubling to
        `max_cooldown` while it keeps failing. `discover`: what discovery lists now, {addr:
        identity} (`registry_view`), asked at most every `discover_every` seconds before a
        batch or a sync: a server out of it gets nothing, one listed under a new identity
        (restarted) is asked for its weights before it gets a rollout."""
        addrs = [_normalise_addr(a) for a in servers if a and a.strip()]
        _check_args(addrs, backend, max_concurrency, stall_timeout, timeout=timeout,
                    control_timeout=control_timeout, probe_timeout=probe_timeout)  # fmt: skip
        self.backend = backend
        self.api_key = api_key
        self.max_concurrency = max_concurrency
        self.timeout = timeout
        self.retries = max(0, retries)
        self.cooldown = cooldown
        self.retry_backoff = retry_backoff
        self.control_timeout = control_timeout
        self.stall_timeout = stall_timeout
        self.probe_timeout = probe_timeout
        self.max_cooldown = max(cooldown, max_cooldown)
        # The engine's wire protocol: routes, bodies and replies (backends/protocol_*.py).
        self.protocol = protocol_for(backend)
        self._probe_path = self.protocol.PROBE_PATH
        self._servers = [_Server(a) for a in dict.fromkeys(addrs)]
        # Breaks ties between equally loaded servers, so an idle pool fills evenly.
        self._rr = itertools.count()
        self._session = None
        self._aiohttp: Any = None  # imported with the first session, not at module import
        self._timeout: Any = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._sem: asyncio.Semaphore | None = None
        self._own_loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._hung: dict[asyncio.Task, str] = {}  # tasks the watchdog cancelled, and why
        # The weight version the pool reported last: what a server that says nothing yet
        # should hold (a restarted one reports its initial version instead).
        self._version_seen: str | None = None
        self._discover = discover
        self._discover_every = discover_every
        self._discovered_at: float | None = None
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Every request says which trainer sends it: a server of ours lets one trainer own
        # its weights at a time (SGLang and vLLM ignore the headers).
        self._headers.update(_owner_headers())
        # What the client's close runs first (blocking, best effort): a weight sync gives up
        # its group and the servers' weights there (worker/weights.py).
        self._closers: list[Callable[[RolloutClient], None]] = []

    # ------------------------------------------------------------------ plumbing

    @property
    def servers(self) -> list[str]:
        return [s.addr for s in self._servers]

    def in_flight(self) -> dict[str, int]:
        return {s.addr: s.in_flight for s in self._servers}

    def live_servers(self) -> list[str]:
        now = time.monotonic()
        return [s.addr for s in self._servers if s.live(now)]

    def _ensure_session(self):
        loop = asyncio.get_running_loop()
        if self._session is not None and self._session_loop is not loop:
            raise UsageError(
                "RolloutClient is bound to the event loop it first ran on",
                hint="from synchronous code use client.run(coro) for every call, "
                "or create one client per event loop",
            )
        if self._session is None:
            import aiohttp

            self._aiohttp = aiohttp
            self._timeout = aiohttp.ClientTimeout(total=self.timeout)
            connector = aiohttp.TCPConnector(
                limit=self.max_concurrency + 8, limit_per_host=0, ttl_dns_cache=300
            )
            self._session = aiohttp.ClientSession(
                connector=connector, headers=self._headers, trust_env=False
            )
            self._session_loop = loop
            self._sem = asyncio.Semaphore(self.max_concurrency)
        return self._session

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run one of this client's coroutines from synchronous code, on a private loop."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            coro.close()
            raise UsageError(
                "RolloutClient.run() called from inside a running event loop",
                hint="await the coroutine instead",
            )
        if self._own_loop is None or self._own_loop.is_closed():
            self._own_loop = asyncio.new_event_loop()
        return self._own_loop.run_until_complete(coro)

    def at_close(self, fn: Callable[[RolloutClient], None]) -> None:
        """Run `fn(client)` when the client closes (once, however often it is asked)."""
        if fn not in self._closers:
            self._closers.append(fn)

    async def close(self) -> None:
        """Also destroys the weight-update group a sync made and gives up the ownership of
        the servers' weights, so a server keeps nothing of a trainer that finished."""
        for fn in self._closers:
            await asyncio.to_thread(fn, self)
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._session is not None:
            await self._session.close()
            self._session = None
            self._session_loop = None

    def close_sync(self) -> None:
        """Close the session and the private loop that `run` created."""
        if self._own_loop is not None and not self._own_loop.is_closed():
            if self._session is not None and self._session_loop is self._own_loop:
                self._own_loop.run_until_complete(self.close())
            self._own_loop.close()
        self._own_loop = None
        self._watchdog = None  # a timer of the loop just closed
        for fn in self._closers:
            fn(self)  # nothing left to do when close() ran

    async def __aenter__(self) -> RolloutClient:
        self._ensure_session()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ choosing servers

    def _pick(self, tried: set[str]) -> _Server | None:
        """The live server with the fewest requests in flight, preferring untried ones."""
        now = time.monotonic()
        best: list[_Server] = []
        best_key: tuple[bool, int] | None = None
        for s in self._servers:  # one pass: this runs once per request
            if s.stale or s.unlisted or s.down_until > now:
                continue
            key = (s.addr in tried, s.in_flight)
            if best_key is None or key < best_key:
                best, best_key = [s], key
            elif key == best_key:
                best.append(s)
        if not best:
            return None
        return best[0] if len(best) == 1 else best[next(self._rr) % len(best)]

    def _soonest_back(self) -> _Server | None:
        candidates = [s for s in self._servers if not s.stale]
        return min(candidates, key=lambda s: s.down_until) if candidates else None

    def _mark_down(self, server: _Server, reason: str) -> None:
        now = time.monotonic()
        if server.down_until <= now:  # a new incident, not another request of the same one
            server.failures += 1
            pause = self.cooldown * 2 ** min(server.failures - 1, 16)
            server.down_until = now + min(pause, self.max_cooldown)
        server.last_error = reason

    def _no_server_error(self, what: str) -> RolloutError:
        lines = []
        for s in self._servers:
            state = "stale weights" if s.stale else (s.last_error or "not tried")
            lines.append(f"  {s.addr}: {state}")
        return RolloutError(
            f"{what}: no inference server left ({len(self._servers)} configured, all failed)",
            hint="check the servers with `areal ps`; their logs with `areal logs`",
            detail="\n".join(lines),
        )

    # ------------------------------------------------------------------ one HTTP exchange

    async def _request(self, server: _Server, method: str, path: str, payload: dict | None = None,
                       timeout: float | None = None, params: dict[str, str] | None = None) -> Any:  # fmt: skip
        """One exchange, failed as `_Retryable` when the server turns out to be hung; the
        same arguments as `_exchange`."""
        if not self.stall_timeout:
            return await self._exchange(server, method, path, payload, timeout, params)
        task = asyncio.current_task()
        server.pending[task] = (time.monotonic(), path)
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().call_later(self._watch_every, self._watch)
        try:
            return await self._exchange(server, method, path, payload, timeout, params)
        except asyncio.CancelledError:
            reason = self._hung.pop(task, None)
            if reason is None:
                raise
            task.uncancel()
            raise _Retryable(reason) from None
        finally:
            del server.pending[task]

    @property
    def _watch_every(self) -> float:
        return max(0.05, min(self.stall_timeout, self.probe_timeout) / 2)

    def _watch(self) -> None:
        """One timer for the whole client, running while requests are in flight: a server
        with a request older than stall_timeout, and no answer to anything for that long,
        is asked whether it is alive; if it does not answer, its requests fail over."""
        now = time.monotonic()
        busy = False
        for server in self._servers:
            if not server.pending:
                continue
            busy = True
            if server.probe is not None and not server.probe.done():
                continue
            oldest = min(start for start, _ in server.pending.values())
            quiet_since = max(oldest, server.answered)
            if now - quiet_since >= self.stall_timeout:
                server.probe = asyncio.ensure_future(self._probe(server))
                server.probe.add_done_callback(lambda f, s=server: self._probed(s, f))
        self._watchdog = (
            asyncio.get_running_loop().call_later(self._watch_every, self._watch) if busy else None
        )

    def _probed(self, server: _Server, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is None and fut.result():
            return
        now = time.monotonic()
        for task, (start, path) in list(server.pending.items()):
            if now - start < self.stall_timeout or task in self._hung:
                continue
            self._hung[task] = (
                f"{server.addr} stopped answering: {path} unanswered for {now - start:.0f}s, "
                f"and no reply to GET {self._probe_path} within {self.probe_timeout:g}s"
            )
            task.cancel()

    async def _probe(self, server: _Server) -> bool:
        try:
            await self._exchange(server, "GET", self._probe_path, timeout=self.probe_timeout)
        except _Retryable as e:
            return e.status is not None  # a 5xx is an answer: alive, though unwell
        except RolloutError:
            pass  # 4xx: alive
        return True

    async def _exchange(
        self,
        server: _Server,
        method: str,
        path: str,
        payload: dict | None = None,
        timeout: float | None = None,
        params: dict[str, str] | None = None,
    ) -> Any:
        session = self._session or self._ensure_session()
        aiohttp = self._aiohttp
        client_timeout = self._timeout if timeout is None else aiohttp.ClientTimeout(total=timeout)
        try:
            async with session.request(
                method,
                f"http://{server.addr}{path}",
                json=payload,
                params=params,
                timeout=client_timeout,
            ) as resp:
                server.answered = time.monotonic()
                if resp.status >= 500 or resp.status == 429:
                    body = (await resp.text())[:300]
                    raise _Retryable(
                        f"HTTP {resp.status} from {path}: {body}",
                        cooldown=resp.status not in (500, 429),
                        status=resp.status,
                    )
                if resp.status >= 400:
                    body = (await resp.text())[:500]
                    hint = (
                        "the server wants an API key: set AREAL_API_KEY or pass api_key="
                        if resp.status in (401, 403)
                        else None
                    )
                    error = _NotFound if resp.status == 404 else RolloutError
                    answer = _answer(body)
                    raise error(
                        f"{server.addr} rejected {method} {path}: HTTP {resp.status}"
                        + (f": {answer}" if answer else ""),
                        hint=hint,
                        detail=body,
                    )
                text = await resp.text()
                server.failures = 0
                if not text.strip():
                    return None
                try:
                    return json.loads(text)
                except ValueError:
                    return text  # /flush_cache answers plain text
        except asyncio.TimeoutError as e:
            took = timeout or self.timeout
            raise _Retryable(f"timed out after {took:g}s on {path}") from e
        except aiohttp.ClientError as e:
            # Connection refused, reset, server disconnected mid-response.
            server.suspect = True
            raise _Retryable(f"{type(e).__name__}: {e}") from e

    async def _get_first(self, server: _Server, paths: Sequence[str], timeout: float,
                         params: dict[str, str] | None = None) -> Any:  # fmt: skip
        """GET the first of `paths` the server has (404 means try the next)."""
        for path in paths[:-1]:
            try:
                return await self._request(server, "GET", path, timeout=timeout, params=params)
            except _NotFound:
                continue
        return await self._request(server, "GET", paths[-1], timeout=timeout, params=params)

    # ------------------------------------------------------------------ generation

    async def generate(self, input_ids: Sequence[int], **sampling: Any) -> Completion:
        """Sample one continuation of `input_ids`, failing over between servers. `sampling`:
        the keywords of the protocol's `sampling_params` (max_new_tokens=128,
        temperature=1.0, top_p=1.0, top_k=-1, stop_token_ids, ignore_eos, seed)."""
        return await self._generate(input_ids, self.protocol.sampling_params(**sampling))

    async def _generate(self, input_ids: Sequence[int], sampling: dict) -> Completion:
        self._ensure_session()
        assert self._sem is not None
        # Tensors and numpy ints are not JSON: plain ints go on the wire.
        prompt = list(map(int, input_ids))
        last: _Retryable | None = None
        async with self._sem:
            report_progress(source="rollout")  # a request began: the one before it ended
            tried: set[str] = set()
            for attempt in range(self.retries + 1):
                server = self._pick(tried)
                if server is None:
                    if attempt == self.retries:
                        break
                    # Everything is cooling down: wait a little, then probe whichever server
                    # comes back first, so one blip on a single-server pool is survivable.
                    await asyncio.sleep(self.retry_backoff * (2**attempt))
                    server = self._soonest_back()
                    if server is None:
                        break
                tried.add(server.addr)
                if server.suspect and not await self._recheck(server):
                    continue
                server.in_flight += 1
                try:
                    proto = self.protocol
                    if proto.NEEDS_FACTS and server.model_name is None:
                        await self._facts(server)
                    path, payload = proto.generate_request(
                        prompt, sampling, server.model_name, self._has_spans(server)
                    )
                    data = await self._request(server, "POST", path, payload)
                    return self._completion(server, proto.parse_completion(
                        data, server.addr, server.weight_version))  # fmt: skip
                except _Retryable as e:
                    last = e
                    if e.cooldown:
                        self._mark_down(server, str(e))
                    else:
                        server.last_error = str(e)
                finally:
                    server.in_flight -= 1
        if last is not None and self.live_servers():
            raise RolloutError(
                f"generate failed after {self.retries + 1} attempts: {last}",
                hint="see the servers' logs (`areal logs`); raise retries= to try harder",
            )
        raise self._no_server_error("generate")

    # Parsing and payloads are plain functions, not coroutines: every await layer on the
    # per-request path costs a frame resumption per I/O event.
    def _completion(self, server: _Server, done: Completion) -> Completion:
        if done.finish_reason == "abort":
            # A pause in abort mode, an /abort_request or a shutdown: the partial output
            # is not a sample of any one policy. Try again (it waits out a pause).
            raise _Retryable(f"{server.addr} aborted the request", cooldown=False)
        if self._went_back(server, done.weight_version):
            # Restarted while nothing failed here (between two requests): the sample is of
            # its base weights, never the trainer's policy.
            raise _Retryable(f"{server.addr} was restarted: it holds its base weights again",
                             cooldown=False)  # fmt: skip
        if done.weight_version is not None:
            server.weight_version = self._version_seen = done.weight_version
        return done

    def _went_back(self, server: _Server, version: str | None) -> bool:
        """Whether `server` reports its initial weights where the pool's moved on: it was
        restarted (versions only move forward otherwise). Then it is out of sampling."""
        if version != INITIAL_VERSION:
            return False
        if server.reset:  # known already: every request that was in flight to it too
            return True
        known = server.weight_version or self._version_seen
        if known in (None, INITIAL_VERSION):
            return False
        _log.warning("%s was restarted: it holds its base weights, not version %s; no rollout "
                     "goes to it until a weight sync reaches it", server.addr, known)  # fmt: skip
        server.stale = server.reset = True
        server.weight_version = version
        return True

    async def _recheck(self, server: _Server) -> bool:
        """Whether a server that stopped answering may have a rollout again: it answers,
        and holds the weights it held (not the base weights of a restart)."""
        try:
            version = await self._fetch_version(server)
        except _Retryable as e:
            if e.cooldown:
                self._mark_down(server, str(e))
            return False
        except RolloutError as e:
            server.last_error = str(e)
            return False
        server.suspect, server.down_until = False, 0.0  # it answers: no cooldown to wait out
        if self._went_back(server, version):
            return False
        if version is not None:
            server.weight_version = version
        return True

    async def _recheck_reset(self) -> None:
        """Servers out of sampling since a restart are back once they report another version
        than their base one: a sync reached them (this client may not be the one that synced:
        only rank 0's client talks to the servers during a sync)."""
        now = time.monotonic()
        waiting = [s for s in self._servers if s.reset and s.down_until <= now]
        if not waiting:
            return
        got = await asyncio.gather(*(self._fetch_version(s) for s in waiting),
                                   return_exceptions=True)  # fmt: skip
        for server, version in zip(waiting, got, strict=True):
            if isinstance(version, BaseException) or version in (None, INITIAL_VERSION):
                continue
            server.stale = server.reset = server.suspect = False
            server.weight_version = version

    async def _facts(self, server: _Server) -> None:
        """What a server whose protocol NEEDS_FACTS serves and which engine version it is,
        asked once however many requests need it at the same moment (the first batch starts
        them all at once)."""
        fut = server.facts
        if fut is None or (fut.done() and (fut.cancelled() or fut.exception() is not None)):
            fut = server.facts = asyncio.ensure_future(self._fetch_facts(server))
        # One waiter's cancellation (its request timed out) must not cancel the others' fetch.
        await asyncio.shield(fut)

    async def _fetch_facts(self, server: _Server) -> None:
        proto = self.protocol
        data = await self._request(server, "GET", proto.MODELS_PATH, timeout=self.control_timeout)
        models = proto.parse_models(data)
        if not models:
            raise RolloutError(f"{server.addr} serves no model (GET {proto.MODELS_PATH} is empty)")
        try:
            got = await self._request(
                server, "GET", proto.ENGINE_VERSION_PATH, timeout=self.control_timeout
            )
            server.engine_version = _version_tuple((got or {}).get("version"))
        except RolloutError:  # 404: not a version that says; speak the newest protocol
            server.engine_version = None
        if server.weight_version is None and not self._has_spans(server):
            # No versions in its completions: know the one it holds now (dev routes only).
            try:
                got = await self._request(server, "GET", proto.VERSION_PATH, timeout=30)
                if isinstance(got, dict):
                    server.weight_version = _version_str(got.get("weight_version"))
            except RolloutError:
                pass
        server.model_name = str(models[0]["id"])

    def _has_spans(self, server: _Server) -> bool:
        """Whether this server returns per-completion weight versions."""
        return self.protocol.has_spans(server.engine_version)

    async def engine_version(self, addr: str) -> tuple[int, ...] | None:
        """The engine version a server runs, e.g. (0, 33), as its protocol asks it (None: it
        did not say). A weight sync asks it of servers whose protocol changed between
        versions."""
        server = self.server(addr)
        if server.model_name is None:
            await self._facts(server)
        return server.engine_version

    async def engine_versions(self) -> dict[str, str | None]:
        """The engine version each reachable server runs ("0.32.0" as x.y); None: it did not
        say, or its protocol has no such question (NEEDS_FACTS)."""

        async def one(s: _Server) -> str | None:
            if not self.protocol.NEEDS_FACTS:
                return None
            await self._facts(s)
            return ".".join(map(str, s.engine_version)) if s.engine_version else None

        results = await self._on_every_server("engine_version", one)
        return {a: r for a, r in results.items() if not isinstance(r, BaseException)}

    async def generate_batch(
        self, prompts: Sequence[Sequence[int]], *, n: int = 1, **sampling: Any
    ) -> list[list[Completion]]:
        """`n` samples for every prompt, all in flight at once (bounded by max_concurrency).

        Returns one list of `n` completions per prompt, in prompt order. The first failure
        cancels the rest and is raised.
        """
        self._ensure_session()
        await self.refresh()
        await self._recheck_reset()
        params = self.protocol.sampling_params(**sampling)
        tasks = [
            asyncio.ensure_future(self._generate(p, params)) for p in prompts for _ in range(n)
        ]
        if not tasks:
            return []
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()
        results = [t.result() for t in tasks]
        return [results[i * n : (i + 1) * n] for i in range(len(prompts))]

    # ------------------------------------------------------------------ control plane

    def _reachable(self) -> list[_Server]:
        now = time.monotonic()
        return [s for s in self._servers if s.down_until <= now and not s.unlisted]

    async def refresh(self) -> None:
        """What discovery lists now (at most every `discover_every` seconds): a server its
        runner took out (dead, restarting) gets nothing; one listed again under another
        identity was restarted, and is back at once, to be asked for its weights first. A
        registry that does not answer changes nothing."""
        now = time.monotonic()
        if self._discover is None or (self._discovered_at is not None
                                      and now - self._discovered_at < self._discover_every):  # fmt: skip
            return
        self._discovered_at = now
        try:
            found = await asyncio.to_thread(self._discover)
        except Exception as e:  # a registry down for a moment: the servers answer for themselves
            _log.debug("discovery refresh failed: %s", e)
            return
        for s in self._servers:
            ident = found.get(s.addr)
            if ident is None:
                s.unlisted = s.listed is not None  # servers never listed are not its to judge
                continue
            if s.listed is not None and ident != s.listed:
                _log.warning("%s is listed again by another process (restarted): its weights "
                             "are asked before it gets a rollout, and a weight sync realigns "
                             "it", s.addr)  # fmt: skip
                s.suspect, s.down_until, s.failures = True, 0.0, 0
            s.listed, s.unlisted = ident, False

    def server(self, addr: str) -> _Server:
        return next(s for s in self._servers if s.addr == addr)

    async def on_servers(self, addrs: Sequence[str], what: str, call: Any) -> dict[str, Any]:
        """`await call(server)` on every server in `addrs` at once. The first failure raises
        `SyncError` naming the servers that failed by then, without waiting for the others
        (a survivor may be blocked on the failed one)."""
        self._ensure_session()
        if not addrs:
            return {}
        targets = {asyncio.ensure_future(call(self.server(a))): self.server(a) for a in addrs}
        done, pending = await asyncio.wait(targets, return_when=asyncio.FIRST_EXCEPTION)
        failed = {}
        for task in done:
            error = task.exception()
            if error is None:
                continue
            server = targets[task]
            if isinstance(error, _Retryable) and error.cooldown:
                self._mark_down(server, str(error))
            else:
                server.last_error = str(error)
            failed[server.addr] = error
        if failed:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            raise SyncError(what, failed)
        return {targets[t].addr: t.result() for t in targets}

    async def _on_every_server(self, what: str, call) -> dict[str, Any]:
        """Run `call(server)` on every server that is not cooling down; failures are recorded."""
        self._ensure_session()
        targets = self._reachable()
        if not targets:
            raise self._no_server_error(what)
        results = await asyncio.gather(*(call(s) for s in targets), return_exceptions=True)
        out: dict[str, Any] = {}
        for server, result in zip(targets, results, strict=True):
            if isinstance(result, _Retryable) and result.cooldown:
                self._mark_down(server, str(result))
            elif isinstance(result, BaseException):
                server.last_error = str(result)
            out[server.addr] = result
        return out

    async def _control(self, server: _Server, path: str, payload: dict | None = None,
                       params: dict[str, str] | None = None, timeout: float | None = None) -> Any:  # fmt: skip
        try:
            data = await self._request(
                server, "POST", path, payload if payload is not None else {},
                timeout or self.control_timeout, params=params,
            )  # fmt: skip
        except _NotFound as e:
            if self.protocol.NOT_FOUND_HINT:
                e.hint = self.protocol.NOT_FOUND_HINT
            raise
        if isinstance(data, dict) and data.get("success") is False:
            answer = str(data.get("message") or data)
            raise RolloutError(f"{server.addr} failed {path}: {answer}", detail=answer)
        return data

    # What the weight sync (worker/weights.py) uses to speak to single servers, beside
    # on_servers: the pool's view, one control call, one plain exchange.

    @property
    def pool(self) -> list[ServerState]:
        """Every server's state (in flight, cooldown, stale, last error, weight version)."""
        return list(self._servers)

    @property
    def headers(self) -> dict[str, str]:
        """The headers every request carries: the API key, the trainer's ownership."""
        return dict(self._headers)

    def reachable(self) -> list[ServerState]:
        """The servers not cooling down after a failure (stale ones included)."""
        return self._reachable()

    def mark_down(self, server: ServerState, reason: str) -> None:
        """Skip `server` for a cooldown, as after a failed request."""
        self._mark_down(server, reason)

    def no_server_error(self, what: str) -> RolloutError:
        """The error naming every server and why it could not serve `what`."""
        return self._no_server_error(what)

    async def control(self, server: ServerState, path: str, payload: dict | None = None,
                      params: dict[str, str] | None = None,
                      timeout: float | None = None) -> Any:  # fmt: skip
        """POST a control route to one server; {"success": false} raises RolloutError."""
        return await self._control(server, path, payload, params, timeout)

    async def send(self, server: ServerState, method: str, path: str,
                   payload: dict | None = None, timeout: float | None = None) -> Any:  # fmt: skip
        """One exchange with one server, failed over by nobody: the caller decides."""
        return await self._request(server, method, path, payload, timeout)

    def pause_mode(self, mode: str | None) -> str:
        family, modes = self.protocol.FAMILY, self.protocol.PAUSE_MODES
        if mode is None:
            return modes[0]
        if mode not in modes:
            raise UsageError(f"pause mode {mode!r} is not one of {family}'s: {', '.join(modes)}")
        return mode

    async def pause(self, mode: str | None = None, servers: Sequence[str] | None = None) -> None:
        """Stop the servers from generating (weights are about to change).

        SGLang/hf modes: `retract` (default: running requests go back to the queue and
        continue after resume, on the new weights), `abort` (they end now; this client
        retries them), `in_place`. vLLM modes: `keep` (default), `abort`, `wait`.
        """
        mode = self.pause_mode(mode)
        path, body, query = self.protocol.pause_request(mode)
        call = lambda s: self._control(s, path, body, params=query)  # noqa: E731
        await self._fan_out("pause", servers, call)

    async def resume(self, servers: Sequence[str] | None = None) -> None:
        path = self.protocol.RESUME_PATH
        await self._fan_out("resume", servers, lambda s: self._control(s, path))

    async def _fan_out(self, what: str, servers: Sequence[str] | None, call: Any) -> None:
        if servers is not None:
            await self.on_servers(servers, what, call)
            return
        results = await self._on_every_server(what, call)
        if all(isinstance(r, BaseException) for r in results.values()):
            first = next(iter(results.values()))
            if isinstance(first, RolloutError):
                raise first
            raise self._no_server_error(what)

    async def _update_one(
        self, server: _Server, path: str, version: str | None, abort_all_requests: bool
    ) -> str | None:
        for route, body in self.protocol.disk_update_requests(path, version, abort_all_requests):
            await self._control(server, route, body)
        reported = await self._fetch_version(server)
        server.weight_version = reported if reported is not None else version
        self._version_seen = server.weight_version or self._version_seen
        server.stale = server.reset = server.suspect = False
        return server.weight_version

    async def update_weights_from_disk(
        self, path: str, *, version: str | int | None = None, abort_all_requests: bool = False
    ) -> str | None:
        """Make every live server load the HF checkpoint at `path`; returns the new version.

        `path` must be readable by the servers (same host or a shared filesystem). A server
        that fails to load is taken out of rotation until a later update succeeds, so no
        sample is ever drawn from weights the trainer has moved past.
        """
        v = _version_str(version)
        results = await self._on_every_server(
            "update_weights_from_disk",
            lambda s: self._update_one(s, str(path), v, abort_all_requests),
        )
        failures = {a: r for a, r in results.items() if isinstance(r, BaseException)}
        for server in self._servers:
            if server.addr in failures or server.addr not in results:
                server.stale = True
        if len(failures) == len(results):
            first = next(iter(failures.values()))
            if isinstance(first, RolloutError):
                raise first
            raise self._no_server_error("update_weights_from_disk")
        versions = {r for r in results.values() if not isinstance(r, BaseException)}
        if v is not None:
            return v
        return next(iter(versions)) if len(versions) == 1 else None

    async def _fetch_version(self, server: _Server) -> str | None:
        """The version a server reports: SGLang `GET /model_info` (the removed
        `/get_weight_version` only when /model_info is missing); vLLM `GET /weight_info`."""
        try:
            data = await self._get_first(server, self.protocol.VERSION_PATHS, 30)
        except _NotFound:
            if not self.protocol.VERSION_OPTIONAL:
                raise
            return server.weight_version
        return self.protocol.parse_version(data)

    async def model_info(self) -> dict[str, Any]:
        """What the first reachable server serves: {"model_path", ...} (SGLang's /model_info).

        Trainers on the servers' filesystem use `model_path` to start from the same weights.
        """
        last: Exception | None = None
        for server in self._servers:
            try:
                return await self._model_info(server)
            except _Retryable as e:
                self._mark_down(server, str(e))
                last = e
        raise self._no_server_error("model_info") from last

    async def _model_info(self, server: _Server) -> dict[str, Any]:
        data = await self._get_first(server, self.protocol.MODEL_INFO_PATHS, 30)
        return self.protocol.parse_model_info(data)

    async def server_states(self) -> dict[str, dict[str, Any]]:
        """{addr: {"weight_version", "model_path"}} of every reachable server: what it holds
        now (SGLang's /model_info moves model_path to the last checkpoint it loaded)."""

        async def one(s: _Server) -> dict[str, Any]:
            info = await self._model_info(s)
            path = info.get("model_path")
            if self.protocol.MODEL_INFO_HAS_VERSION:
                version = _version_str(info.get("weight_version"))
            else:
                version = await self._fetch_version(s)
            s.weight_version = version
            return {"weight_version": version, "model_path": path}

        results = await self._on_every_server("server_state", one)
        errors = [r for r in results.values() if isinstance(r, BaseException)]
        if len(errors) == len(results):
            raise (
                errors[0]
                if isinstance(errors[0], RolloutError)
                else self._no_server_error("server_state")
            )
        return {a: r for a, r in results.items() if not isinstance(r, BaseException)}

    async def server_info(self, addr: str) -> dict[str, Any]:
        """SGLang's /server_info of one server: its launch arguments (tp_size, pp_size, dtype,
        device ...). vLLM: {"world_size"} from /get_world_size (rl/online/api_router.py:269)."""
        server = self.server(addr)
        proto = self.protocol
        data = await self._get_first(server, proto.SERVER_INFO_PATHS, 30, proto.SERVER_INFO_QUERY)
        return proto.parse_server_info(data)

    async def weight_versions(self) -> dict[str, str | None]:
        """The weight version each reachable server reports."""
        results = await self._on_every_server("weight_version", self._fetch_version)
        out: dict[str, str | None] = {}
        for addr, r in results.items():
            if not isinstance(r, BaseException):
                out[addr] = r
                self.server(addr).weight_version = r
        return out

    def mark_updated(self, addrs: Sequence[str], version: str | None) -> None:
        """After a weight sync: these servers hold the new weights, every other one is stale."""
        fresh = set(addrs)
        if version is not None and fresh:
            self._version_seen = version
        for s in self._servers:
            if s.addr in fresh:
                s.stale = s.reset = s.suspect = False
                s.weight_version = version if version is not None else s.weight_version
            else:
                s.stale = True


class SyncError(RolloutError):
    """A control call failed on some servers; `failed` maps each address to its error."""

    def __init__(self, what: str, failed: dict[str, BaseException]):
        # Each server's answer in the message itself: a trainer's traceback shows no detail.
        answers = "; ".join(f"{a}: {_short(getattr(e, 'message', None) or e)}"
                            for a, e in failed.items())  # fmt: skip
        detail = "\n".join(f"  {a}: {getattr(e, 'message', None) or e}" for a, e in failed.items())
        super().__init__(f"{what} failed on {answers}", detail=detail)
        self.failed = failed


def unreachable(error: BaseException) -> bool:
    """Whether `error` is a server that never answered (refused, reset, timed out, hung)."""
    return isinstance(error, _Retryable) and error.status is None


def _short(text: Any, limit: int = 400) -> str:
    text = str(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _answer(body: str) -> str:
    """What a server said in an error body: SGLang's {"message"}, {"error"}, or the text."""
    try:
        data = json.loads(body)
    except ValueError:
        return _short(body.strip(), 300)
    if isinstance(data, dict):
        for key in ("message", "error", "detail"):
            value = data.get(key)
            if isinstance(value, dict):
                value = value.get("message")
            if value:
                return _short(value, 300)
    return _short(body.strip(), 300)


# Made once per process: every client of one trainer process is the same owner.
_OWNER_TOKEN = uuid.uuid4().hex


def _owner_headers() -> dict[str, str]:
    host, pid = socket.gethostname(), os.getpid()
    job = "/".join(
        filter(None, (os.environ.get("AREAL_EXPERIMENT"), os.environ.get("AREAL_TRIAL")))
    )
    name = f"{job or 'a trainer'} (pid {pid} on {host})"
    return {OWNER_HEADER: _OWNER_TOKEN, OWNER_NAME_HEADER: name,
            OWNER_PROCESS_HEADER: f"{host}:{pid}"}  # fmt: skip


def registry_view(url: str | None, experiment: str, trial: str) -> Callable[[], dict[str, Any]]:
    """What `discover` asks: the servers the registry lists for a job now, each as (pid,
    start), which changes when its runner starts it again. The registry is opened once, at
    the first call (an etcd registry logs in)."""
    opened: list[Any] = []

    def listed() -> dict[str, Any]:
        if not opened:
            opened.append(open_registry(url))
        return {e.addr: (e.pid, e.started) for e in opened[0].list(experiment, trial).servers}

    return listed
