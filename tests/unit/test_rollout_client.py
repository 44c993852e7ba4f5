"""RolloutClient against real aiohttp servers on loopback that speak SGLang's and vLLM's protocols.

The stubs compute a deterministic continuation (prompt's last token + 1, + 2, ...) so every
answer can be checked, and they count requests and concurrent requests per server. The
SGLang stub follows 0.5.23 where the client depends on it: unknown sampling keys are a 400
(sglang/api/v1/api_types.py:1256-1320), the version lives in GET /model_info
(srt/entrypoints/http_server.py:812-850) and moves on a disk update only when the request
names one (srt/managers/tokenizer_manager.py:2313-2318); `old_routes` serves the removed
/get_weight_version instead.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from areal_cli.errors import UsageError
from areal_cli.worker.rollout import RolloutClient, RolloutError

SGLANG_SAMPLING_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
    "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "min_new_tokens", "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval",
    "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
}  # fmt: skip


class Stub:
    """One inference server: `kind` is "sglang" (also the hf server's protocol) or "vllm"."""

    def __init__(
        self,
        kind: str = "sglang",
        *,
        delay: float = 0.0,
        api_key: str | None = None,
        old_routes: bool = False,
    ):
        self.kind = kind
        self.old_routes = old_routes
        self.aborts = 0  # answer this many /generate requests as aborted first
        self.delay = delay
        self.api_key = api_key
        self.status: int | None = None  # force this HTTP status on /generate
        self.fail_update = False
        self.requests = 0
        self.active = 0
        self.max_active = 0
        self.auth_headers: list[str | None] = []
        self.bodies: list[dict] = []
        self.calls: list[str] = []
        self.version = "default"
        self.control_bodies: list[tuple[str, dict]] = []
        self.loaded_path: str | None = None
        self.runner: web.AppRunner | None = None
        self.addr = ""

    async def start(self) -> str:
        app = web.Application()
        if self.kind == "sglang":
            app.router.add_post("/generate", self._generate)
            app.router.add_post("/pause_generation", self._control)
            app.router.add_post("/continue_generation", self._control)
            app.router.add_post("/update_weights_from_disk", self._update)
            if self.old_routes:
                app.router.add_get("/get_weight_version", self._version)
                app.router.add_get("/get_model_info", self._model_info)
            else:
                app.router.add_get("/model_info", self._model_info)
        else:
            app.router.add_get("/v1/models", self._models)
            app.router.add_post("/v1/completions", self._completions)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.addr = f"127.0.0.1:{port}"
        return self.addr

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    def _check_auth(self, request: web.Request) -> None:
        header = request.headers.get("Authorization")
        self.auth_headers.append(header)
        if self.api_key and header != f"Bearer {self.api_key}":
            raise web.HTTPUnauthorized(text="bad api key")

    async def _serve(self, request: web.Request) -> dict | web.Response:
        self._check_auth(request)
        body = await request.json()
        self.bodies.append(body)
        self.requests += 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.active -= 1
        if self.status is not None:
            return web.Response(status=self.status, text="forced failure")
        return body

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await self._serve(request)
        if isinstance(body, web.Response):
            return body
        unknown = set(body["sampling_params"]) - SGLANG_SAMPLING_KEYS
        if unknown:
            return web.json_response({"error": f"unknown field `{unknown.pop()}`"}, status=400)
        last = body["input_ids"][-1]
        n = body["sampling_params"]["max_new_tokens"]
        out = [(last + 1 + i) % 256 for i in range(n)]
        if self.aborts:
            self.aborts -= 1
            return web.json_response({"text": "", "output_ids": out[:1], "meta_info": {
                "output_token_logprobs": [[-0.1, out[0], None]],
                "finish_reason": {"type": "abort", "message": "Aborted", "status_code": None,
                                  "err_type": None},
                "weight_version": self.version,
            }})  # fmt: skip
        return web.json_response(
            {
                "text": "",
                "output_ids": out,
                "meta_info": {
                    "output_token_logprobs": [
                        [-0.25 * (i + 1), t, None] for i, t in enumerate(out)
                    ],
                    "finish_reason": {"type": "length", "length": n},
                    "prompt_tokens": len(body["input_ids"]),
                    "completion_tokens": n,
                    "weight_version": self.version,
                },
            }
        )

    async def _models(self, request: web.Request) -> web.StreamResponse:
        self._check_auth(request)
        model = {"id": "stub-model", "root": "/models/stub"}
        return web.json_response({"object": "list", "data": [model]})

    async def _model_info(self, request: web.Request) -> web.StreamResponse:
        self._check_auth(request)
        return web.json_response(
            {"model_path": "/models/stub", "is_generation": True, "weight_version": self.version}
        )

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._serve(request)
        if isinstance(body, web.Response):
            return body
        if body.get("model") != "stub-model":
            return web.Response(status=404, text="model not found")
        last = body["prompt"][-1]
        out = [(last + 1 + i) % 256 for i in range(body["max_tokens"])]
        return web.json_response(
            {
                "choices": [
                    {
                        "index": 0,
                        "text": "",
                        "finish_reason": "length",
                        "logprobs": {
                            "tokens": [f"token_id:{t}" for t in out],
                            "token_logprobs": [-0.5] * len(out),
                            "top_logprobs": [],
                            "text_offset": [],
                        },
                    }
                ]
            }
        )

    async def _control(self, request: web.Request) -> web.StreamResponse:
        self._check_auth(request)
        self.calls.append(request.path)
        self.control_bodies.append((request.path, await request.json()))
        return web.json_response({"message": "ok", "status": "ok"})

    async def _update(self, request: web.Request) -> web.StreamResponse:
        self._check_auth(request)
        body = await request.json()
        self.calls.append(request.path)
        self.control_bodies.append((request.path, body))
        if self.fail_update:
            return web.json_response({"success": False, "message": "no such file"}, status=400)
        self.loaded_path = body["model_path"]
        if body.get("weight_version") is not None:
            self.version = body["weight_version"]
        return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})

    async def _version(self, request: web.Request) -> web.StreamResponse:
        self._check_auth(request)
        return web.json_response({"weight_version": self.version})


async def _started(*stubs: Stub) -> list[str]:
    return [await s.start() for s in stubs]


async def _stopped(*stubs: Stub) -> None:
    for s in stubs:
        await s.stop()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def test_sglang_generate_parses_tokens_logprobs_and_sends_api_key():
    async def main():
        stub = Stub("sglang", api_key="sekret")
        addrs = await _started(stub)
        try:
            async with RolloutClient(addrs, backend="sglang", api_key="sekret") as client:
                c = await client.generate([5, 9], max_new_tokens=3, temperature=0.7, top_k=4)
        finally:
            await _stopped(stub)
        assert c.output_ids == [10, 11, 12]
        assert c.logprobs == [-0.25, -0.5, -0.75]
        assert c.finish_reason == "length"
        assert c.server == addrs[0]
        assert c.weight_version == "default"
        assert stub.auth_headers == ["Bearer sekret"]
        sent = stub.bodies[0]
        assert sent["return_logprob"] is True
        assert sent["sampling_params"]["temperature"] == 0.7
        assert sent["sampling_params"]["top_k"] == 4

    run(main())


def test_vllm_generate_uses_token_id_prompt_and_parses_token_ids():
    async def main():
        stub = Stub("vllm", api_key="k1")
        addrs = await _started(stub)
        try:
            async with RolloutClient(addrs, backend="vllm", api_key="k1") as client:
                c = await client.generate([1, 2, 3], max_new_tokens=4, stop_token_ids=[7])
        finally:
            await _stopped(stub)
        assert c.output_ids == [4, 5, 6, 7]
        assert c.logprobs == [-0.5] * 4
        assert c.finish_reason == "length"
        sent = stub.bodies[0]
        assert sent["prompt"] == [1, 2, 3]
        assert sent["logprobs"] == 1
        assert sent["return_tokens_as_token_ids"] is True
        assert sent["stop_token_ids"] == [7]
        # /v1/models and /v1/completions both carried the key
        assert stub.auth_headers == ["Bearer k1", "Bearer k1"]

    run(main())


def test_wrong_api_key_fails_fast_with_a_hint():
    async def main():
        stub = Stub("sglang", api_key="right")
        addrs = await _started(stub)
        try:
            async with RolloutClient(addrs, api_key="wrong", retries=3) as client:
                with pytest.raises(RolloutError) as info:
                    await client.generate([1], max_new_tokens=1)
        finally:
            await _stopped(stub)
        assert "401" in info.value.message
        assert "AREAL_API_KEY" in (info.value.hint or "")
        assert stub.requests == 0 and len(stub.auth_headers) == 1  # a 4xx is not retried

    run(main())


def test_equal_servers_share_load_evenly():
    async def main():
        stubs = [Stub(delay=0.05) for _ in range(3)]
        addrs = await _started(*stubs)
        try:
            async with RolloutClient(addrs, max_concurrency=6) as client:
                await client.generate_batch([[1]] * 30, max_new_tokens=1)
        finally:
            await _stopped(*stubs)
        assert [s.requests for s in stubs] == [10, 10, 10]
        assert [s.max_active for s in stubs] == [2, 2, 2]

    run(main())


def test_least_in_flight_sends_less_to_a_slow_server():
    async def main():
        slow, fast = Stub(delay=0.3), Stub(delay=0.01)
        addrs = await _started(slow, fast)
        try:
            async with RolloutClient(addrs, max_concurrency=4) as client:
                t0 = time.perf_counter()
                await client.generate_batch([[1]] * 40, max_new_tokens=1)
                elapsed = time.perf_counter() - t0
        finally:
            await _stopped(slow, fast)
        assert slow.requests + fast.requests == 40
        # Round-robin would put 20 on the slow one (~3 s); least-in-flight keeps it busy
        # with a couple while the fast one drains the rest.
        assert slow.requests <= 6, (slow.requests, fast.requests)
        assert elapsed < 1.5

    run(main())


def test_concurrency_is_bounded():
    async def main():
        stub = Stub(delay=0.05)
        addrs = await _started(stub)
        try:
            async with RolloutClient(addrs, max_concurrency=4) as client:
                groups = await client.generate_batch(
                    [[1], [2], [3], [4], [5]], n=4, max_new_tokens=2
                )
        finally:
            await _stopped(stub)
        assert stub.max_active == 4
        assert stub.requests == 20
        # one list per prompt, n completions each, in prompt order
        assert [[c.output_ids for c in g] for g in groups] == [
            [[p + 1, p + 2]] * 4 for p in range(1, 6)
        ]

    run(main())


def test_timeout_raises_rollout_error():
    async def main():
        stub = Stub(delay=5.0)
        addrs = await _started(stub)
        try:
            async with RolloutClient(addrs, timeout=0.3, retries=0) as client:
                t0 = time.perf_counter()
                with pytest.raises(RolloutError) as info:
                    await client.generate([1], max_new_tokens=1)
                elapsed = time.perf_counter() - t0
        finally:
            await _stopped(stub)
        assert elapsed < 2.0
        assert "timed out" in (info.value.detail or "")
        assert addrs[0] in (info.value.detail or "")

    run(main())


def test_failover_when_a_server_stops_mid_run():
    async def main():
        a, b = Stub(delay=0.05), Stub(delay=0.05)
        addrs = await _started(a, b)
        try:
            async with RolloutClient(addrs, max_concurrency=8, cooldown=30) as client:
                batch = asyncio.ensure_future(client.generate_batch([[1]] * 80, max_new_tokens=1))
                # Once it has answered some (however busy this machine is), it stops.
                for _ in range(1000):
                    if a.requests - a.active >= 2:
                        break
                    await asyncio.sleep(0.01)
                await a.stop()  # in-flight requests to it are cut, new ones refused
                groups = await batch
                live = client.live_servers()
        finally:
            await _stopped(a, b)
        completions = [c for g in groups for c in g]
        assert len(completions) == 80
        assert all(c.output_ids == [2] for c in completions)
        served_by_a = sum(c.server == addrs[0] for c in completions)
        assert 0 < served_by_a < 40
        assert served_by_a + b.requests >= 80
        assert live == [addrs[1]]

    run(main())


def test_5xx_moves_requests_to_a_healthy_server():
    async def main():
        bad, good = Stub(), Stub()
        bad.status = 503
        addrs = await _started(bad, good)
        try:
            async with RolloutClient(addrs, cooldown=30) as client:
                groups = await client.generate_batch([[3]] * 10, max_new_tokens=1)
                # The first burst is split before any answer comes back ...
                first_burst = bad.requests
                groups += await client.generate_batch([[3]] * 10, max_new_tokens=1)
        finally:
            await _stopped(bad, good)
        assert all(c.server == addrs[1] for g in groups for c in g)
        assert 1 <= first_burst <= 5
        # ... after which the failed server is skipped while it cools down.
        assert bad.requests == first_burst

    run(main())


def test_500_is_retried_elsewhere_but_keeps_the_server_in_rotation():
    async def main():
        flaky, good = Stub(), Stub()
        flaky.status = 500
        addrs = await _started(flaky, good)
        try:
            async with RolloutClient(addrs, retries=1) as client:
                c = await client.generate([1], max_new_tokens=1)
                live = client.live_servers()
                # With nowhere else to go, the request fails with the server's answer.
                good.status = 500
                with pytest.raises(RolloutError) as info:
                    await client.generate([1], max_new_tokens=1)
        finally:
            await _stopped(flaky, good)
        assert c.output_ids == [2]
        assert live == addrs
        assert "failed after 2 attempts" in info.value.message
        assert "HTTP 500" in info.value.message

    run(main())


def test_all_servers_dead_is_a_clear_error():
    async def main():
        a, b = Stub(), Stub()
        addrs = await _started(a, b)
        await _stopped(a, b)
        async with RolloutClient(addrs, retries=2, retry_backoff=0.05) as client:
            t0 = time.perf_counter()
            with pytest.raises(RolloutError) as info:
                await client.generate([1], max_new_tokens=1)
            elapsed = time.perf_counter() - t0
        assert "no inference server left" in info.value.message
        for addr in addrs:
            assert addr in info.value.detail
        assert info.value.hint and "areal ps" in info.value.hint
        assert elapsed < 2.0

    run(main())


def test_pause_update_resume_and_versions():
    async def main():
        a, b = Stub(), Stub()
        addrs = await _started(a, b)
        try:
            async with RolloutClient(addrs) as client:
                assert await client.weight_versions() == {addrs[0]: "default", addrs[1]: "default"}
                await client.pause()
                version = await client.update_weights_from_disk("/ckpt/step1", version=1)
                await client.resume()
                after = await client.weight_versions()
                c = await client.generate([1], max_new_tokens=1)
        finally:
            await _stopped(a, b)
        assert version == "1"
        assert after == {addrs[0]: "1", addrs[1]: "1"}
        assert c.weight_version == "1"
        for s in (a, b):
            assert s.calls == [
                "/pause_generation",
                "/update_weights_from_disk",
                "/continue_generation",
            ]
            assert s.loaded_path == "/ckpt/step1"
            # A sync pauses in retract mode (srt/managers/io_struct.py:1927-1946), and the
            # version goes as a string (io_struct.py:1978-1979) or SGLang keeps the old one.
            assert s.control_bodies[0] == ("/pause_generation", {"mode": "retract"})
            assert s.control_bodies[1][1]["weight_version"] == "1"

    run(main())


def test_versions_fall_back_to_the_removed_route_only_on_old_servers():
    async def main():
        old = Stub(old_routes=True)
        addrs = await _started(old)
        try:
            async with RolloutClient(addrs) as client:
                version = await client.update_weights_from_disk("/ckpt/1", version="v1")
                info = await client.model_info()
        finally:
            await _stopped(old)
        assert version == "v1" and info["model_path"] == "/models/stub"

    run(main())


def test_only_sglang_sampling_keys_go_on_the_wire_and_the_seed_is_sampling_seed():
    async def main():
        stub = Stub()
        addrs = await _started(stub)
        try:
            async with RolloutClient(addrs) as client:
                await client.generate([1], max_new_tokens=2, seed=7, ignore_eos=True)
                await client.generate_batch([[1]], max_new_tokens=2, seed=3)
        finally:
            await _stopped(stub)
        for body in stub.bodies:
            assert set(body["sampling_params"]) <= SGLANG_SAMPLING_KEYS
        assert [b["sampling_params"]["sampling_seed"] for b in stub.bodies] == [7, 3]

    run(main())


def test_aborted_completions_are_retried_never_returned():
    async def main():
        stub = Stub()
        stub.aborts = 2
        addrs = await _started(stub)
        try:
            async with RolloutClient(addrs, retries=3, retry_backoff=0.01) as client:
                c = await client.generate([4], max_new_tokens=3)
                stub.aborts = 5
                with pytest.raises(RolloutError, match="aborted"):
                    await client.generate([4], max_new_tokens=3)
                live = client.live_servers()
        finally:
            await _stopped(stub)
        assert c.finish_reason == "length" and c.output_ids == [5, 6, 7]
        # An abort is not the server's fault: it stays in rotation.
        assert live == addrs

    run(main())


def test_pause_modes_are_the_backends_own():
    client = RolloutClient(["127.0.0.1:1"], backend="sglang")
    assert client.pause_mode(None) == "retract" and client.pause_mode("in_place") == "in_place"
    with pytest.raises(UsageError, match="retract, abort, in_place"):
        client.pause_mode("keep")
    vllm = RolloutClient(["127.0.0.1:1"], backend="vllm")
    assert vllm.pause_mode(None) == "keep"


def test_a_server_that_missed_an_update_leaves_rotation_until_the_next():
    async def main():
        a, b = Stub(), Stub()
        b.fail_update = True
        addrs = await _started(a, b)
        try:
            async with RolloutClient(addrs) as client:
                version = await client.update_weights_from_disk("/ckpt/2", version=2)
                stale_out = client.live_servers()
                served = {c.server for g in await client.generate_batch([[1]] * 6) for c in g}
                b.fail_update = False
                await client.update_weights_from_disk("/ckpt/3", version=3)
                back = client.live_servers()
        finally:
            await _stopped(a, b)
        assert version == "2"
        assert stale_out == [addrs[0]] and served == {addrs[0]}
        assert back == addrs

    run(main())


def test_sync_run_keeps_one_session_across_calls():
    stub = Stub()
    loop = asyncio.new_event_loop()
    try:
        addr = loop.run_until_complete(stub.start())
        # The stub lives on `loop`; serve it from a thread while the client uses its own loop.
        import threading

        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        client = RolloutClient([addr])
        first = client.run(client.generate([1], max_new_tokens=1))
        second = client.run(client.generate_batch([[2], [3]], max_new_tokens=1))
        client.close_sync()
        assert first.output_ids == [2]
        assert [g[0].output_ids for g in second] == [[3], [4]]
    finally:
        asyncio.run_coroutine_threadsafe(stub.stop(), loop).result(timeout=5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        loop.close()


def test_model_info_names_the_served_checkpoint_on_both_protocols():
    # No `async with`: the first call of a fresh client opens the session itself.
    async def main():
        sglang, vllm = Stub("sglang"), Stub("vllm")
        addrs = await _started(sglang, vllm)
        try:
            a = RolloutClient([addrs[0]], backend="hf")
            b = RolloutClient([addrs[1]], backend="vllm")
            infos = [await a.model_info(), await b.model_info()]
            await a.close()
            await b.close()
        finally:
            await _stopped(sglang, vllm)
        assert [i["model_path"] for i in infos] == ["/models/stub", "/models/stub"]

    run(main())


def test_bad_construction_is_a_usage_error():
    with pytest.raises(UsageError):
        RolloutClient([])
    with pytest.raises(UsageError):
        RolloutClient(["127.0.0.1:1"], backend="tgi")
    for bad in ({"timeout": 0}, {"control_timeout": -1}, {"stall_timeout": float("nan")},
                {"probe_timeout": 0}):  # fmt: skip
        with pytest.raises(UsageError):
            RolloutClient(["127.0.0.1:1"], **bad)


def _silent_server() -> tuple[object, str]:
    """A hung server as the network sees it (a SIGSTOPped process): the kernel accepts
    connections, nothing ever answers."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock, f"127.0.0.1:{sock.getsockname()[1]}"


def test_a_hung_server_costs_stall_plus_probe_not_the_request_timeout():
    async def main():
        sock, hung = _silent_server()
        good = Stub(delay=0.02)
        (ok,) = await _started(good)
        try:
            async with RolloutClient([hung, ok], timeout=600, control_timeout=600,
                                     stall_timeout=0.5, probe_timeout=0.5) as client:  # fmt: skip
                t0 = time.perf_counter()
                groups = await client.generate_batch([[1, 2]] * 8, n=2, max_new_tokens=2)
                took = time.perf_counter() - t0
                assert {c.server for g in groups for c in g} == {ok}
                assert "stopped answering" in client.server(hung).last_error
                # A control call on it fails, naming it, as soon.
                t0 = time.perf_counter()
                with pytest.raises(RolloutError) as info:
                    await client.pause(servers=[hung, ok])
                failed_after = time.perf_counter() - t0
                # A live server that is merely slow is never given up.
                good.delay = 2.0
                slow = await client.generate([3], max_new_tokens=1)
        finally:
            await _stopped(good)
            sock.close()
        assert took < 3.0, took
        assert hung in info.value.message and failed_after < 3.0, failed_after
        assert slow.server == ok

    run(main())


def test_a_refused_control_call_prints_each_servers_answer_and_an_empty_set_is_no_error():
    from areal_cli.worker.rollout import SyncError

    async def main():
        a, b = Stub(), Stub()
        a.fail_update = b.fail_update = True
        addrs = await _started(a, b)
        try:
            async with RolloutClient(addrs, retries=0) as client:
                assert await client.on_servers([], "resume", client.control) == {}
                await client.resume([])  # was: ValueError "Set of Tasks/Futures is empty"
                body = {"model_path": "/x"}
                with pytest.raises(SyncError) as e:
                    await client.on_servers(addrs, "weight sync", lambda s: client.control(
                        s, "/update_weights_from_disk", body))  # fmt: skip
        finally:
            await _stopped(a, b)
        # The server's answer in the message itself, which is all a rank's traceback shows.
        text = str(e.value)
        assert text.startswith("weight sync failed on "), text
        for addr in e.value.failed:
            assert (
                f"{addr}: {addr} rejected POST /update_weights_from_disk: HTTP 400: no such file"
                in text
            )

    run(main())


def test_a_restarted_server_gets_no_rollout_until_a_sync_reaches_it():
    # Discovery lists each server as (pid, start); a restart lists it anew, at its base weights.
    async def main():
        a, b = Stub("sglang"), Stub("sglang")
        addrs = await _started(a, b)
        listed = {addrs[0]: (1, 1.0), addrs[1]: (2, 1.0)}
        try:
            async with RolloutClient(addrs, backend="sglang", discover=lambda: dict(listed),
                                     discover_every=0) as client:  # fmt: skip
                await client.update_weights_from_disk("/ckpt/3", version="3")
                await client.generate_batch([[1]], n=4, max_new_tokens=1)
                # Out of discovery (its runner took it out: dead, restarting): no requests.
                del listed[addrs[0]]
                before = a.requests
                got = await client.generate_batch([[1]], n=8, max_new_tokens=1)
                assert {c.server for g in got for c in g} == {addrs[1]} and a.requests == before
                # Back under another process, at its base weights: asked, never sampled.
                a.version = "default"
                listed[addrs[0]] = (3, 2.0)
                got = await client.generate_batch([[1]], n=8, max_new_tokens=1)
                assert {c.server for g in got for c in g} == {addrs[1]}
                assert a.requests == before and client.server(addrs[0]).reset
                assert {c.weight_version for g in got for c in g} == {"3"}
                # Another rank's client synced it: its version moved on, it is back.
                a.version = "4"
                b.version = "4"
                got = await client.generate_batch([[1]], n=16, max_new_tokens=1)
                assert {c.server for g in got for c in g} == set(addrs)
                assert {c.weight_version for g in got for c in g} == {"4"}
        finally:
            await _stopped(a, b)

    run(main())


def test_a_server_restarted_unseen_has_its_samples_discarded():
    # No discovery, no failure seen: the first completion at its base weights tells.
    async def main():
        a, b = Stub("sglang"), Stub("sglang")
        addrs = await _started(a, b)
        try:
            async with RolloutClient(addrs, backend="sglang") as client:
                await client.update_weights_from_disk("/ckpt/5", version="5")
                a.version = "default"
                got = await client.generate_batch([[1]], n=16, max_new_tokens=1)
                assert {c.weight_version for g in got for c in g} == {"5"}
                assert {c.server for g in got for c in g} == {addrs[1]}
                assert client.server(addrs[0]).reset and client.server(addrs[0]).stale
                # The next sync reaches it: back in rotation.
                await client.update_weights_from_disk("/ckpt/6", version="6")
                got = await client.generate_batch([[1]], n=16, max_new_tokens=1)
                assert {c.server for g in got for c in g} == set(addrs)
        finally:
            await _stopped(a, b)

    run(main())
