"""HTTP side of the hf reference server: SGLang 0.5.23's native routes plus OpenAI
/v1/completions.

Every SGLang route served here takes the same request fields, validates them the same way
and answers with the same status codes and reply shapes as SGLang 0.5.23
(srt/entrypoints/http_server.py; see protocol.py for the sources):

    GET  /health /health_generate /ready      empty bodies; 503 while the model loads; /ready
                                              also while paused or after a failed health check
    GET  /ping                                200 while healthy, paused or not (SageMaker's)
    GET  /model_info /server_info             (/get_model_info, /get_server_info: deprecated
                                              aliases SGLang still serves)
    POST /generate                            single or batch, per-token logprobs, weight
                                              version spans, retraction counts
    POST /pause_generation {mode}             abort | retract | in_place
    POST /continue_generation
    POST /update_weights_from_disk            {model_path, weight_version, flush_cache, ...}
    POST /update_weight_version               {new_version, abort_all_requests}
    POST /init_weights_update_group /begin_weight_update /update_weights_from_distributed
         /end_weight_update /destroy_weights_update_group       (weight_update.py)
    POST /release_weight_owner                beyond SGLang: see "one trainer" below
    GET|POST /flush_cache                     text
    POST /abort_request {rid, abort_all}      empty body
    GET  /v1/models, POST /v1/completions     vLLM/OpenAI subset

With an API key every route but /health*, /ready and /metrics wants `Authorization: Bearer
KEY`, as SGLang's middleware does (srt/utils/auth.py:96-103).

Beyond SGLang: a pause ends by itself once no control request came for --pause-timeout
seconds (none running either), so a trainer that dies mid-sync cannot leave the server
paused for good (`PauseLease`). And one trainer owns the weights at a time: a weight-control
request carrying another trainer's X-Areal-Weight-Owner token is refused with 409, naming the
owner (`WeightOwner`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from areal_cli.request_errors import TEXT_MAX, Counts
from areal_cli.server import protocol
from areal_cli.server.batcher import Batcher
from areal_cli.server.engine import Engine, GenRequest, GenResult
from areal_cli.server.protocol import BodyError, ContractError, RequestError, parse_body
from areal_cli.server.weight_update import (
    OWNER_HEADER,
    OWNER_NAME_HEADER,
    OWNER_PROCESS_HEADER,
    WeightOwner,
    WeightUpdates,
)

log = logging.getLogger("areal.server")

UNAUTHENTICATED_PREFIXES = ("/health", "/ready", "/metrics")
# Answered with an empty 503 while the model loads (http_server.py:714-735).
PROBES = frozenset({"/health", "/health_generate", "/ready", "/ping"})
# Not counted as answered requests: probes, and what the runner and `areal ps` read (the
# runner reads /server_info every renewal; it must not hide a trainer refused every time).
UNCOUNTED = PROBES | {"/server_info", "/get_server_info", "/model_info", "/get_model_info",
                      "/v1/models"}  # fmt: skip
# What a trainer sends around a weight sync: each one renews a pause's lease, and a pause
# never ends by itself while one of them runs.
CONTROL_PATHS = frozenset(
    {
        "/pause_generation",
        "/continue_generation",
        "/update_weights_from_disk",
        "/update_weight_version",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weights_from_distributed",
        "/flush_cache",
        "/abort_request",
    }
)
# What changes the served weights (or holds them still): one trainer's at a time.
OWNED_PATHS = CONTROL_PATHS - {"/flush_cache", "/abort_request"}
# One answer for every path a checkpoint cannot be loaded from: whether a path exists, can be
# read or holds a checkpoint is nobody's business but the server owner's (its log says).
DISK_UPDATE_FAILED = "Failed to update weights: no checkpoint this server can load at model_path."


class PauseLease:
    """A pause that nobody continues ends by itself: `timeout` seconds after the last control
    request, and never while one runs. SGLang has no such bound; a trainer killed between
    /pause_generation and /continue_generation would leave it paused for good."""

    def __init__(self, batcher: Batcher, timeout: float):
        self.batcher = batcher
        self.timeout = timeout
        self.busy = 0
        self.renewed = time.monotonic()
        self.paused_at: float | None = None
        self._watch: asyncio.Task | None = None

    def renew(self) -> None:
        self.renewed = time.monotonic()

    def paused(self) -> None:
        self.renew()
        self.paused_at = self.renewed
        if self.timeout > 0 and (self._watch is None or self._watch.done()):
            self._watch = asyncio.create_task(self._expire())

    async def _expire(self) -> None:
        while self.batcher.paused:
            left = self.renewed + self.timeout - time.monotonic()
            if left <= 0 and not self.busy:
                self.batcher.resume()
                log.warning(
                    "generation resumed by itself: paused %.0fs ago and no control request for "
                    "%gs (--pause-timeout); the trainer that paused it is gone",
                    time.monotonic() - (self.paused_at or self.renewed),
                    self.timeout,
                )
                return
            await asyncio.sleep(min(max(left, 0.05), 1.0))

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()


@dataclass
class ServerState:
    engine: Engine
    batcher: Batcher
    args: dict[str, Any]
    served_model_name: str
    api_key: str | None = None
    pause_timeout: float = 0.0
    ready: bool = False
    # SGLang's ServerStatus.UnHealthy: set by a health check that got no token in time,
    # cleared by one that did (http_server.py:780-798); /ready and /ping answer 503 meanwhile.
    unhealthy: bool = False
    started: float = field(default_factory=time.time)
    weight_updates: int = 0
    updates: WeightUpdates | None = None
    lease: PauseLease | None = None
    owner: WeightOwner = field(default_factory=WeightOwner)
    # Tells a restarted server at the same address from the one a trainer synced before.
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Its answers of the last minute: what `areal ps` and the watchdog see of refused requests
    # (a trainer that retries one forever looks busy; only the server can tell). UNCOUNTED
    # routes are left out: a paused server answers /health 503, and reading the counters is
    # no request of a trainer's.
    request_errors: Counts = field(default_factory=lambda: Counts())


STATE = web.AppKey("state", ServerState)


def _error_text(resp: web.StreamResponse) -> str:
    """The message of an error reply, in any of SGLang's three error shapes, else its text."""
    body = getattr(resp, "body", None)
    raw = body if isinstance(body, bytes) else b""
    try:
        got = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return raw.decode(errors="replace").strip() or (resp.reason or "")
    if isinstance(got, dict):
        for key in ("message", "error"):
            v = got.get(key)
            if isinstance(v, dict):
                v = v.get("message")
            if isinstance(v, str) and v:
                return v
    return json.dumps(got)


def build_app(state: ServerState) -> web.Application:
    if state.updates is None:
        state.updates = WeightUpdates(
            state.engine, state.batcher, float(state.args.get("weight_sync_timeout") or 600)
        )
    if state.lease is None:
        state.lease = PauseLease(state.batcher, state.pause_timeout)
    app = web.Application(
        middlewares=[_counted, _errors, _auth, _readiness, _owner, _lease],
        client_max_size=64 << 20,
    )
    app[STATE] = state
    r = app.router
    r.add_get("/health", health)
    r.add_get("/health_generate", health)
    r.add_get("/ready", ready)
    r.add_get("/ping", ping)
    r.add_get("/model_info", model_info)
    r.add_get("/get_model_info", model_info)
    r.add_get("/server_info", server_info)
    r.add_get("/get_server_info", server_info)
    r.add_post("/generate", generate)
    r.add_put("/generate", generate)
    r.add_post("/update_weights_from_disk", update_weights_from_disk)
    r.add_post("/update_weight_version", update_weight_version)
    r.add_post("/init_weights_update_group", init_weights_update_group)
    r.add_post("/destroy_weights_update_group", destroy_weights_update_group)
    r.add_post("/begin_weight_update", begin_weight_update)
    r.add_post("/end_weight_update", end_weight_update)
    r.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    r.add_post("/release_weight_owner", release_weight_owner)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_get("/flush_cache", flush_cache)
    r.add_post("/flush_cache", flush_cache)
    r.add_post("/abort_request", abort_request)
    r.add_get("/v1/models", v1_models)
    r.add_post("/v1/completions", v1_completions)
    return app


# -- middlewares -----------------------------------------------------------------------------


def _openai_error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": status}}, status=status
    )


@web.middleware
async def _counted(request: web.Request, handler: Any) -> web.StreamResponse:
    if request.path in UNCOUNTED:
        return await handler(request)
    errors, route = request.app[STATE].request_errors, f"{request.method} {request.path}"
    try:
        resp = await handler(request)
    except web.HTTPException as e:  # an unknown route, a method not allowed
        errors.record(route, e.status, (e.text or e.reason)[:TEXT_MAX])
        raise
    except asyncio.CancelledError:  # the client went away: no answer to count
        raise
    errors.record(route, resp.status, _error_text(resp)[:TEXT_MAX] if resp.status >= 400 else "")
    return resp


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ContractError as e:  # http_server.py:937-939
        return web.json_response({"error": str(e)}, status=400)
    except RequestError as e:  # http_server.py:2246-2250
        return web.json_response({"error": {"message": str(e)}}, status=400)
    except BodyError as e:  # http_server.py:636-698
        return web.json_response(protocol.validation_error(str(e)), status=400)
    except web.HTTPException:
        raise
    except Exception as e:
        log.exception("error serving %s %s", request.method, request.path)
        return _openai_error(500, f"{type(e).__name__}: {e}", "InternalServerError")


@web.middleware
async def _auth(request: web.Request, handler: Any) -> web.StreamResponse:
    key = request.app[STATE].api_key
    if key and not request.path.startswith(UNAUTHENTICATED_PREFIXES):
        if request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
    return await handler(request)


@web.middleware
async def _readiness(request: web.Request, handler: Any) -> web.StreamResponse:
    if not request.app[STATE].ready:
        if request.path in PROBES:
            return web.Response(status=503)
        return _openai_error(503, "the model is loading", "ServiceUnavailableError")
    return await handler(request)


@web.middleware
async def _lease(request: web.Request, handler: Any) -> web.StreamResponse:
    if request.path not in CONTROL_PATHS:
        return await handler(request)
    lease = request.app[STATE].lease
    lease.busy += 1
    lease.renew()
    try:
        return await handler(request)
    finally:
        lease.busy -= 1
        lease.renew()


@web.middleware
async def _owner(request: web.Request, handler: Any) -> web.StreamResponse:
    token = request.headers.get(OWNER_HEADER)
    if token:
        owner = request.app[STATE].owner
        if request.path in OWNED_PATHS:
            refusal = owner.claim(
                token,
                request.headers.get(OWNER_NAME_HEADER) or "an unnamed trainer",
                request.headers.get(OWNER_PROCESS_HEADER) or "",
            )
            if refusal:
                log.warning("refused %s: %s", request.path, refusal)
                return web.json_response({"success": False, "message": refusal}, status=409)
        else:
            owner.renew(token)
    return await handler(request)


async def _json(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BodyError(f"JSON decode error: {e}") from e
    if not isinstance(body, dict):
        raise BodyError("Input should be a valid dictionary or object")
    return body


def _result(ok: bool, message: str, **extra: Any) -> web.Response:
    """{success, message} with 200 or 400, the shape of every weight-control route."""
    return web.json_response(
        {"success": ok, "message": message, **extra}, status=200 if ok else 400
    )


# -- probes and info -------------------------------------------------------------------------


async def ready(request: web.Request) -> web.Response:
    """TokenizerManager.is_ready (tokenizer_manager.py:732-734): not paused and healthy."""
    st = request.app[STATE]
    return web.Response(status=503 if st.batcher.paused or st.unhealthy else 200)


async def ping(request: web.Request) -> web.Response:
    """SageMaker's /ping (http_server.py:2189-2199): healthy, paused or not."""
    return web.Response(status=503 if request.app[STATE].unhealthy else 200)


async def health(request: web.Request) -> web.Response:
    """/health and /health_generate (http_server.py:721-800; /health generates too, as
    SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION defaults to true, srt/environ.py:344): a
    batch in progress proves the model alive; otherwise one greedy token of input_ids [0]
    must come back within SGLANG_HEALTH_CHECK_TIMEOUT seconds (default 20,
    http_server.py:218), else 503. So a server paused with nothing running answers 503
    once that time has passed, as SGLang does."""
    st = request.app[STATE]
    if st.batcher.busy:
        return web.Response(status=200)
    params = protocol.sampling_from({"max_new_tokens": 1, "temperature": 0.0}, 1)
    probe = GenRequest([0], params, rid=f"HEALTH_CHECK_{uuid.uuid4().hex}")
    try:
        # A probe must not shift the seeds of real requests.
        await asyncio.wait_for(st.batcher.submit([probe], seeded=False), health_timeout())
    except asyncio.TimeoutError:
        log.error("health check failed: no token within %ss", health_timeout())
        st.unhealthy = True
        return web.Response(status=503)
    st.unhealthy = False
    return web.Response(status=200)


def health_timeout() -> float:
    return float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20))


async def model_info(request: web.Request) -> web.Response:
    """http_server.py:812-850."""
    st = request.app[STATE]
    cfg = st.engine.model.config
    return web.json_response(
        {
            # Moved by a weight update from disk, as SGLang's is.
            "model_path": st.engine.weights_path,
            "served_model_name": st.served_model_name,
            "tokenizer_path": st.engine.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": st.batcher.weight_version,
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None),
        }
    )


async def server_info(request: web.Request) -> web.Response:
    """http_server.py:863-895: the launch arguments under SGLang's names, plus live state."""
    st = request.app[STATE]
    e = st.engine
    return web.json_response(
        {
            **st.args,
            "tp_size": 1,
            "pp_size": 1,
            "dp_size": 1,
            "backend": "hf",
            "served_model_name": st.served_model_name,
            "weights_path": e.weights_path,
            "device": e.device,
            "dtype": str(e.dtype).removeprefix("torch."),
            "context_length": e.context_length,
            "vocab_size": e.vocab_size,
            "weight_updates": st.weight_updates,
            "startup_time": st.started,
            "uptime_s": round(time.time() - st.started, 3),
            "internal_states": [{"batching": st.batcher.stats()}],
            "batching": st.batcher.stats(),
            "weight_update": st.updates.stats() if st.updates else None,
            "weight_owner": st.owner.describe(),
            "instance_id": st.instance_id,
            "frontend": "hf",
            # Beyond SGLang: what `areal ps` and the watchdog show of refused requests.
            "request_errors": st.request_errors.to_json(),
        }
    )


# -- generation --------------------------------------------------------------------------------


async def generate(request: web.Request) -> web.Response:
    st = request.app[STATE]
    g = protocol.decode_generate(await _json(request))
    if g.unsupported:
        raise RequestError(f"the hf server does not support {', '.join(g.unsupported)}")
    if g.stream:
        raise RequestError("the hf server does not stream; send stream: false")
    prompts, batched = _prompts(st.engine, g.input_ids, g.text)
    n = len(prompts)
    params = _per_item(g.sampling_params, n, "sampling_params")
    want_logprob = _per_item(g.return_logprob, n, "return_logprob")
    top_n = _per_item(g.top_logprobs_num, n, "top_logprobs_num")
    rids = _rids(g.rid, n, batched)

    reqs = []
    for i, ids in enumerate(prompts):
        sp = protocol.sampling_from(params[i], st.engine.vocab_size)
        req = GenRequest(
            input_ids=ids,
            params=sp,
            rid=rids[i],
            top_logprobs_num=int(top_n[i] or 0) if want_logprob[i] else 0,
        )
        st.engine.check_request(req)
        reqs.append(req)

    started = time.perf_counter()
    results = await st.batcher.submit(reqs)
    latency = time.perf_counter() - started
    out = [
        _sglang_output(req, res, bool(want_logprob[i]), latency)
        for i, (req, res) in enumerate(zip(reqs, results, strict=True))
    ]
    return web.json_response(out if batched else out[0])


def _sglang_output(req: GenRequest, res: GenResult, logprob: bool, latency: float) -> dict:
    """One /generate reply (tokenizer_manager.py:2507-2560, utils/weight_versions.py:90-107)."""
    n = len(res.output_ids)
    spans = [s for s in res.spans if s[1] < n or s[1] == 0]
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": res.finish_reason,
        "prompt_tokens": res.prompt_tokens,
        "weight_version": spans[-1][0] if spans else res.weight_version,
        "num_retractions": res.retractions,
    }
    if logprob:
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [
            [lp, tid, None] for lp, tid in zip(res.logprobs, res.output_ids, strict=True)
        ]
        meta["output_token_logprobs_length"] = n
        if req.top_logprobs_num:
            meta["input_top_logprobs"] = []
            meta["output_top_logprobs"] = [
                [[lp, tid, None] for tid, lp in top] for top in res.top_logprobs
            ]
    meta["reasoning_tokens"] = 0
    meta["completion_tokens"] = n
    meta["cached_tokens"] = 0
    meta["weight_versions"] = [{"version": v, "start": a, "end": min(b, n)} for v, a, b in spans]
    meta["e2e_latency"] = round(latency, 6)
    return {"text": res.text, "output_ids": res.output_ids, "meta_info": meta}


# -- pause, abort, cache -----------------------------------------------------------------------


async def pause_generation(request: web.Request) -> web.Response:
    mode = parse_body(protocol.PauseGenerationReq, await _json(request)).mode
    st = request.app[STATE]
    await st.batcher.pause(mode)
    st.lease.paused()
    if st.lease.timeout > 0:
        log.info("generation paused (%s); it resumes by itself after %gs without a control "
                 "request (--pause-timeout)", mode, st.lease.timeout)  # fmt: skip
    else:
        log.info("generation paused (%s)", mode)
    # http_server.py:1831-1841
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    await _json(request)
    request.app[STATE].batcher.resume()
    log.info("generation continued")
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def flush_cache(request: web.Request) -> web.Response:
    """http_server.py:1025-1040. Each batch builds its KV cache from scratch; the only cache
    kept is that of a batch paused in place, which a flush may not drop."""
    try:
        timeout = float(request.query.get("timeout", 0.0))
    except ValueError:
        raise BodyError("Input should be a valid number: timeout") from None
    if timeout < 0:
        raise BodyError("Input should be greater than or equal to 0: timeout")
    batcher = request.app[STATE].batcher
    deadline = time.monotonic() + timeout
    while not batcher.idle() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    if batcher.idle():
        return web.Response(text=protocol.FLUSH_OK)
    return web.Response(text=protocol.FLUSH_FAILED, status=400)


async def abort_request(request: web.Request) -> web.Response:
    """http_server.py:1721-1731: AbortReq {rid, abort_all}; an empty 200."""
    req = parse_body(protocol.AbortReq, await _json(request))
    batcher = request.app[STATE].batcher
    if req.abort_all:
        await batcher.abort_all()
    elif req.rid:
        await batcher.abort(req.rid)
    return web.Response(status=200)


# -- weights -----------------------------------------------------------------------------------


async def update_weights_from_disk(request: web.Request) -> web.Response:
    """http_server.py:1300-1326 with UpdateWeightFromDiskReqInput (io_struct.py:1970-1993)."""
    st = request.app[STATE]
    req = parse_body(protocol.UpdateWeightFromDiskReq, await _json(request))
    path, version, flush = req.model_path, req.weight_version, req.flush_cache
    if req.abort_all_requests:
        await st.batcher.abort_all()
    started = time.perf_counter()
    try:
        state = await st.batcher.worker.run(st.engine.read_weights, path)
    except Exception as e:  # WeightLoadError, or anything a strange path makes the loader raise
        log.warning("weight update from %s failed, keeping version %s: %s", path,
                    st.batcher.weight_version, e)  # fmt: skip
        return _result(False, DISK_UPDATE_FAILED, num_paused_requests=0)
    old = st.batcher.weight_version
    await st.batcher.swap_weights(state, path, None)
    st.weight_updates += 1
    if flush and st.batcher.holds_cache:
        # weight_updater.py:120-135: the weights changed, the version did not.
        return _result(False, protocol.FLUSH_AFTER_UPDATE_FAILED, num_paused_requests=0)
    message = "Succeeded to update model weights."
    if version is not None:
        st.batcher.weight_version = version
        message += f" Weight version updated to {version}."
    log.info("weights updated from %s in %.2fs; version %s -> %s", path,
             time.perf_counter() - started, old, st.batcher.weight_version)  # fmt: skip
    return _result(True, message, num_paused_requests=0)


async def update_weight_version(request: web.Request) -> web.Response:
    """http_server.py:1527-1556 with UpdateWeightVersionReqInput (io_struct.py:2155-2159)."""
    st = request.app[STATE]
    req = parse_body(protocol.UpdateWeightVersionReq, await _json(request))
    version = req.new_version
    if req.abort_all_requests:
        await st.batcher.abort_all()
    st.batcher.weight_version = version
    return web.json_response(
        {"success": True, "message": f"Weight version updated to {version}", "new_version": version}
    )


async def init_weights_update_group(request: web.Request) -> web.Response:
    """http_server.py:1404-1418 with InitWeightsUpdateGroupReqInput (io_struct.py:2126-2138)."""
    req = parse_body(protocol.InitWeightsUpdateGroupReq, await _json(request))
    ok, message = await request.app[STATE].updates.init_group(
        master_address=req.master_address,
        master_port=req.master_port,
        rank_offset=req.rank_offset,
        world_size=req.world_size,
        group_name=req.group_name,
        backend=req.backend,
    )
    return _result(ok, message)


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    req = parse_body(protocol.DestroyWeightsUpdateGroupReq, await _json(request))
    return _result(*await request.app[STATE].updates.destroy_group(req.group_name))


async def begin_weight_update(request: web.Request) -> web.Response:
    parse_body(protocol.BeginWeightUpdateReq, await _json(request))
    return _result(*request.app[STATE].updates.begin())


async def end_weight_update(request: web.Request) -> web.Response:
    await _json(request)
    st = request.app[STATE]
    ok, message = await st.updates.end()
    if ok:
        st.weight_updates += 1
    return _result(ok, message)


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    """http_server.py:1488-1504 with UpdateWeightsFromDistributedReqInput (io_struct.py:2002-2019).

    Both protocols: 0.5.23 wants the update inside /begin_weight_update ..
    /end_weight_update; 0.5.10.post1 (the SGLang AReaL pins) has no session and loads each
    request at once (srt/managers/scheduler_update_weights_mixin.py:73-85), which is what
    AReaL's trainer sends. A request outside a session is therefore a session of its own:
    installed when it succeeds, nothing when it fails."""
    st = request.app[STATE]
    req = parse_body(protocol.UpdateWeightsFromDistributedReq, await _json(request))
    if req.abort_all_requests:  # tokenizer_manager: abort before the update, in both versions
        await st.batcher.abort_all()
    alone = st.updates.session is None
    if alone:
        st.updates.begin()
    ok, message = await st.updates.update(
        names=req.names,
        dtypes=req.dtypes,
        shapes=req.shapes,
        group_name=req.group_name,
        weight_version=req.weight_version,
        load_format=req.load_format,
    )
    if alone:
        ended, _ = await st.updates.end()
        if ok and ended:
            st.weight_updates += 1
    return _result(ok, message)


async def release_weight_owner(request: web.Request) -> web.Response:
    """Beyond SGLang: the owning trainer gives up its ownership (see WeightOwner)."""
    await _json(request)
    token = request.headers.get(OWNER_HEADER) or ""
    if request.app[STATE].owner.release(token):
        return _result(True, "Released the ownership of the weights.")
    return _result(False, "This trainer does not own the weights.")


# -- OpenAI / vLLM ---------------------------------------------------------------------------


async def v1_models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": st.served_model_name,
                    "object": "model",
                    "created": int(st.started),
                    "owned_by": "areal",
                    "root": st.engine.model_path,
                    "parent": None,
                    "max_model_len": st.engine.context_length,
                }
            ],
        }
    )


async def v1_completions(request: web.Request) -> web.Response:
    st = request.app[STATE]
    body = await _json(request)
    if body.get("stream"):
        raise RequestError("the hf server does not stream; send stream: false")
    model = body.get("model")
    if model not in (None, st.served_model_name, st.engine.model_path):
        return _openai_error(404, f"The model `{model}` does not exist.", "NotFoundError")
    if body.get("prompt") is None:
        raise RequestError("prompt is required")
    prompts, _ = _prompts(st.engine, *_openai_prompt(body["prompt"]))
    n = int(body.get("n") or 1)
    if n < 1:
        raise RequestError("n must be >= 1")
    top_n = body.get("logprobs")
    top_n = None if top_n is None else int(top_n)
    seed = body.get("seed")
    as_ids = bool(body.get("return_tokens_as_token_ids"))

    reqs = []
    for ids in prompts:
        for j in range(n):
            params = {
                "max_new_tokens": body.get("max_tokens", 16),
                "temperature": body.get("temperature"),
                "top_p": body.get("top_p"),
                "top_k": body.get("top_k"),
                "stop": body.get("stop"),
                "stop_token_ids": body.get("stop_token_ids"),
                "ignore_eos": body.get("ignore_eos", False),
                "sampling_seed": None if seed is None else int(seed) + j,
            }
            sp = protocol.sampling_from(protocol.decode_sampling(params), st.engine.vocab_size)
            req = GenRequest(ids, sp, rid=uuid.uuid4().hex, top_logprobs_num=top_n or 0)
            st.engine.check_request(req)
            reqs.append(req)

    results = await st.batcher.submit(reqs)
    choices = []
    for index, (req, res) in enumerate(zip(reqs, results, strict=True)):
        choice: dict[str, Any] = {
            "index": index,
            "text": res.text,
            "logprobs": None,
            "finish_reason": res.finish_reason["type"],
            "stop_reason": res.finish_reason.get("matched"),
        }
        if top_n is not None:
            choice["logprobs"] = _openai_logprobs(st.engine, res, as_ids)
        if body.get("return_token_ids"):
            choice["prompt_token_ids"] = req.input_ids
            choice["token_ids"] = res.output_ids
        if body.get("return_weight_versions"):
            choice["weight_versions"] = [
                {"version": v, "start": a, "end": b} for v, a, b in res.spans
            ]
        choices.append(choice)
    prompt_tokens = sum(len(ids) for ids in prompts)
    completion_tokens = sum(len(r.output_ids) for r in results)
    return web.json_response(
        {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": st.served_model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }
    )


def _openai_logprobs(engine: Engine, res: GenResult, as_ids: bool) -> dict[str, Any]:
    def name(tid: int) -> str:
        return f"token_id:{tid}" if as_ids else engine.token_str(tid)

    tokens = [name(t) for t in res.output_ids]
    offsets, at = [], 0
    for t in res.output_ids:
        offsets.append(at)
        at += len(engine.token_str(t))
    return {
        "tokens": tokens,
        "token_logprobs": res.logprobs,
        "top_logprobs": [{name(t): lp for t, lp in top} for top in res.top_logprobs] or None,
        "text_offset": offsets,
    }


def _openai_prompt(prompt: Any) -> tuple[Any, Any]:
    """OpenAI prompts: a string, a list of strings, a token list or a list of token lists."""
    if isinstance(prompt, str):
        return None, prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return None, prompt
    return prompt, None


# -- shared parsing --------------------------------------------------------------------------


def _prompts(engine: Engine, input_ids: Any, text: Any) -> tuple[list[list[int]], bool]:
    """Token prompts and whether the request was a batch."""
    if input_ids is None and text is None:
        # io_struct.py:445-455
        raise RequestError("Either text, input_ids or input_embeds should be provided.")
    if text is not None:
        if isinstance(text, str):
            return [engine.encode(text)], False
        if isinstance(text, list) and all(isinstance(t, str) for t in text):
            return [engine.encode(t) for t in text], True
        raise RequestError("Text should be a list for batch processing.")
    if isinstance(input_ids, list) and input_ids and all(isinstance(t, list) for t in input_ids):
        return [_token_list(ids) for ids in input_ids], True
    return [_token_list(input_ids)], False


def _token_list(ids: Any) -> list[int]:
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise RequestError("input_ids must be a list of integers or a list of such lists")
    return ids


def _rids(rid: Any, n: int, batched: bool) -> list[str]:
    """io_struct.py:760-790: one id per item; a string prefixes generated ids in a batch."""
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if isinstance(rid, str):
        return [rid] if not batched else [f"{rid}_{i}" for i in range(n)]
    if len(rid) != n:
        raise RequestError(
            "The specified rids length mismatch with the batch_size for batch processing."
        )
    return list(rid)


def _per_item(value: Any, n: int, name: str) -> list[Any]:
    """SGLang batch fields: one value for all items, or a list with one per item."""
    if isinstance(value, list) and (n > 1 or (value and isinstance(value[0], dict))):
        if len(value) != n:
            raise RequestError(f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n
