"""HTTP side of the hf reference server: SGLang-native endpoints plus OpenAI /v1/completions.

SGLang subset: GET /health (503 while the model loads), /health_generate, /get_model_info,
/get_server_info, /get_weight_version; POST /generate, /update_weights_from_disk,
/pause_generation, /continue_generation, /flush_cache, /abort_request.
vLLM/OpenAI subset: GET /v1/models, POST /v1/completions.

With an API key every endpoint but /health and /health_generate wants
`Authorization: Bearer KEY`, as SGLang's api-key middleware does.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from areal_cli.server.batcher import Batcher
from areal_cli.server.engine import (
    Engine,
    GenRequest,
    GenResult,
    RequestError,
    SamplingParams,
    WeightLoadError,
)

log = logging.getLogger("areal.server")

UNAUTHENTICATED = frozenset({"/health", "/health_generate"})


@dataclass
class ServerState:
    engine: Engine
    batcher: Batcher
    args: dict[str, Any]
    served_model_name: str
    api_key: str | None = None
    ready: bool = False
    started: float = field(default_factory=time.time)
    weight_updates: int = 0


STATE = web.AppKey("state", ServerState)


def build_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[_errors, _auth, _readiness], client_max_size=64 << 20)
    app[STATE] = state
    r = app.router
    r.add_get("/health", health)
    r.add_get("/health_generate", health_generate)
    r.add_get("/get_model_info", get_model_info)
    r.add_get("/get_server_info", get_server_info)
    r.add_get("/get_weight_version", get_weight_version)
    r.add_post("/generate", generate)
    r.add_post("/update_weights_from_disk", update_weights_from_disk)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_route("*", "/flush_cache", flush_cache)
    r.add_post("/abort_request", abort_request)
    r.add_get("/v1/models", v1_models)
    r.add_post("/v1/completions", v1_completions)
    return app


# -- middlewares -----------------------------------------------------------------------------


def _error(status: int, message: str, kind: str = "BadRequestError") -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": status}}, status=status
    )


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as e:
        return _error(400, str(e))
    except web.HTTPException:
        raise
    except Exception as e:
        log.exception("error serving %s %s", request.method, request.path)
        return _error(500, f"{type(e).__name__}: {e}", "InternalServerError")


@web.middleware
async def _auth(request: web.Request, handler: Any) -> web.StreamResponse:
    key = request.app[STATE].api_key
    if key and request.path not in UNAUTHENTICATED:
        if request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
    return await handler(request)


@web.middleware
async def _readiness(request: web.Request, handler: Any) -> web.StreamResponse:
    if not request.app[STATE].ready:
        return _error(503, "the model is loading", "ServiceUnavailableError")
    return await handler(request)


async def _json(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    return body


# -- SGLang-native ---------------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    # The readiness middleware already answered 503 while loading.
    return web.Response(status=200)


async def health_generate(request: web.Request) -> web.Response:
    st = request.app[STATE]
    prompt = [st.engine.pad_token_id]
    params = SamplingParams(max_new_tokens=1, temperature=0)
    # A probe must not shift the seeds of real requests.
    await st.batcher.submit([GenRequest(prompt, params, rid="health")], seeded=False)
    return web.Response(status=200)


async def get_model_info(request: web.Request) -> web.Response:
    st = request.app[STATE]
    cfg = st.engine.model.config
    return web.json_response(
        {
            "model_path": st.engine.model_path,
            "tokenizer_path": st.engine.model_path,
            "is_generation": True,
            "weight_version": st.batcher.weight_version,
            "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None),
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }
    )


async def get_server_info(request: web.Request) -> web.Response:
    st = request.app[STATE]
    e = st.engine
    return web.json_response(
        {
            **st.args,
            "backend": "hf",
            "served_model_name": st.served_model_name,
            "weights_path": e.weights_path,
            "device": e.device,
            "dtype": str(e.dtype).removeprefix("torch."),
            "context_length": e.context_length,
            "vocab_size": e.vocab_size,
            "weight_version": st.batcher.weight_version,
            "weight_updates": st.weight_updates,
            "uptime_s": round(time.time() - st.started, 3),
            "batching": st.batcher.stats(),
        }
    )


async def get_weight_version(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": request.app[STATE].batcher.weight_version})


async def generate(request: web.Request) -> web.Response:
    st = request.app[STATE]
    body = await _json(request)
    if body.get("stream"):
        raise RequestError("streaming is not supported by the hf server; send stream: false")
    prompts, batched = _prompts(st.engine, body.get("input_ids"), body.get("text"))
    n = len(prompts)
    params = _per_item(body.get("sampling_params"), n, "sampling_params")
    want_logprob = _per_item(body.get("return_logprob", False), n, "return_logprob")
    top_n = _per_item(body.get("top_logprobs_num", 0), n, "top_logprobs_num")
    rids = _per_item(body.get("rid"), n, "rid")

    reqs = []
    for i, ids in enumerate(prompts):
        sp = SamplingParams.from_dict(params[i])
        req = GenRequest(
            input_ids=ids,
            params=sp,
            rid=str(rids[i] or uuid.uuid4().hex),
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
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": res.finish_reason,
        "prompt_tokens": res.prompt_tokens,
        "completion_tokens": len(res.output_ids),
        "cached_tokens": 0,
        "weight_version": res.weight_version,
        "e2e_latency": round(latency, 6),
    }
    if logprob:
        meta["output_token_logprobs"] = [
            [lp, tid, None] for lp, tid in zip(res.logprobs, res.output_ids, strict=True)
        ]
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = [
                [[lp, tid, None] for tid, lp in top] for top in res.top_logprobs
            ]
    return {"text": res.text, "output_ids": res.output_ids, "meta_info": meta}


async def update_weights_from_disk(request: web.Request) -> web.Response:
    st = request.app[STATE]
    body = await _json(request)
    path = body.get("model_path")
    if not path or not isinstance(path, str):
        return web.json_response(
            {"success": False, "message": "model_path is required"}, status=400
        )
    started = time.perf_counter()
    try:
        state = await st.batcher.worker.run(st.engine.read_weights, path)
    except WeightLoadError as e:
        log.warning(
            "weight update from %s failed, keeping version %s: %s",
            path,
            st.batcher.weight_version,
            e,
        )
        return web.json_response({"success": False, "message": str(e)}, status=400)
    aborted = await st.batcher.abort_all() if body.get("abort_all_requests") else 0
    old = st.batcher.weight_version
    new = body.get("weight_version")
    new = (
        str(new)
        if new is not None
        else (str(int(old) + 1) if old.isdigit() else str(st.weight_updates + 1))
    )
    await st.batcher.swap_weights(state, path, new)
    st.weight_updates += 1
    took = time.perf_counter() - started
    log.info(
        "weights updated: version %s -> %s from %s in %.2fs%s",
        old,
        new,
        path,
        took,
        f" ({aborted} requests aborted)" if aborted else "",
    )
    return web.json_response(
        {
            "success": True,
            "message": f"weights loaded from {path}; weight_version {new}",
            "num_paused_requests": 0,
            "weight_version": new,
        }
    )


async def pause_generation(request: web.Request) -> web.Response:
    request.app[STATE].batcher.pause()
    log.info("generation paused")
    return web.json_response({"success": True, "message": "generation paused"})


async def continue_generation(request: web.Request) -> web.Response:
    request.app[STATE].batcher.resume()
    log.info("generation continued")
    return web.json_response({"success": True, "message": "generation continued"})


async def flush_cache(request: web.Request) -> web.Response:
    # Each batch builds its KV cache from scratch; there is nothing kept between requests.
    return web.json_response({"success": True, "message": "cache flushed"})


async def abort_request(request: web.Request) -> web.Response:
    body = await _json(request)
    if not body.get("abort_all"):
        raise RequestError('the hf server aborts only all requests: send {"abort_all": true}')
    n = await request.app[STATE].batcher.abort_all()
    return web.json_response({"success": True, "message": f"{n} requests aborted"})


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
        raise RequestError("streaming is not supported by the hf server; send stream: false")
    model = body.get("model")
    if model not in (None, st.served_model_name, st.engine.model_path):
        return _error(404, f"The model `{model}` does not exist.", "NotFoundError")
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
            sp = SamplingParams.from_dict(
                {
                    "max_new_tokens": body.get("max_tokens", 16),
                    "temperature": body.get("temperature"),
                    "top_p": body.get("top_p"),
                    "top_k": body.get("top_k"),
                    "stop": body.get("stop"),
                    "stop_token_ids": body.get("stop_token_ids"),
                    "ignore_eos": body.get("ignore_eos", False),
                    "seed": None if seed is None else int(seed) + j,
                }
            )
            req = GenRequest(ids, sp, top_logprobs_num=top_n or 0)
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
    if (input_ids is None) == (text is None):
        raise RequestError("send exactly one of input_ids and text")
    if text is not None:
        if isinstance(text, str):
            return [engine.encode(text)], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [engine.encode(t) for t in text], True
        raise RequestError("text must be a string or a non-empty list of strings")
    if isinstance(input_ids, list) and input_ids and all(isinstance(t, list) for t in input_ids):
        return [_token_list(ids) for ids in input_ids], True
    return [_token_list(input_ids)], False


def _token_list(ids: Any) -> list[int]:
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise RequestError("input_ids must be a list of integers or a list of such lists")
    return ids


def _per_item(value: Any, n: int, name: str) -> list[Any]:
    """SGLang batch fields: one value for all items, or a list with one per item."""
    if isinstance(value, list) and (n > 1 or (value and isinstance(value[0], dict))):
        if len(value) != n:
            raise RequestError(f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n
