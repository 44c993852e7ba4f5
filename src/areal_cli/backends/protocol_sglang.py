"""SGLang 0.5.23's HTTP protocol, which areal's `hf` server speaks too.

`POST /generate` with `input_ids` and `sampling_params` (only keys SGLang knows: it answers
400 to any other; its seed key is `sampling_seed`); versions from `GET /model_info` and each
reply's `meta_info.weight_version`; control: /pause_generation {mode}, /continue_generation,
/update_weights_from_disk {model_path, weight_version}, and the distributed update routes
(/init_weights_update_group, /update_weights_from_distributed,
/destroy_weights_update_group).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from areal_cli.backends.protocol import Completion, spans, version_str

FAMILY = "sglang"
# srt/managers/io_struct.py:1927-1946; the first is what a weight sync uses by default.
PAUSE_MODES = ("retract", "abort", "in_place")
# The cheap question that tells a hung server from a slow one.
PROBE_PATH = "/model_info"
RESUME_PATH = "/continue_generation"
# Routes its API key guards, cheap to ask: /health, /ready and /metrics are open
# (srt/utils/auth.py:96-106); an older server without /model_info has /v1/models.
GUARDED_PATHS = ("/model_info", "/v1/models")
# What `paused` reads: /ready is 503 while paused or unhealthy (TokenizerManager.is_ready,
# tokenizer_manager.py:732-734, http_server.py:714-718), /ping 503 only while unhealthy
# (http_server.py:2189-2199); the hf server also says it in /server_info "batching.paused".
READY_PATH = "/ready"
PING_PATH = "/ping"
# Each tuple: the route, then older names tried when the newer answers 404.
VERSION_PATHS = ("/model_info", "/get_weight_version")
VERSION_OPTIONAL = False  # a server without them is broken, not old
MODEL_INFO_PATHS = ("/model_info", "/get_model_info")
MODEL_INFO_HAS_VERSION = True  # /model_info carries weight_version
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
SERVER_INFO_QUERY = None
# Whether a request needs what the server serves first (its model's name, its version).
NEEDS_FACTS = False
# The distributed update (srt/entrypoints/http_server.py).
INIT_GROUP_PATH = "/init_weights_update_group"
UPDATE_DISTRIBUTED_PATH = "/update_weights_from_distributed"
DESTROY_GROUP_PATH = "/destroy_weights_update_group"
# areal's hf server lets one trainer own its weights at a time: a distributed update runs
# inside a session (SGLang answers 404 to these, which the sync tolerates where it may).
BEGIN_UPDATE_PATH = "/begin_weight_update"
END_UPDATE_PATH = "/end_weight_update"
RELEASE_OWNER_PATH = "/release_weight_owner"
# Whether a control route's 404 means a server started without its dev routes.
NOT_FOUND_HINT = None
# Its weights move over a torch.distributed group that the trainer and the servers join
# (the routes above), not over a transfer engine of the server's own.
NATIVE_WEIGHT_TRANSFER = False
# Whether readiness tells a paused server (/ready 503, /ping 200) from a running one.
PAUSED_BY_READINESS = True
# Its steps of a distributed weight sync (a torch group the servers join).
WEIGHT_SYNC = "areal_cli.backends.sync_sglang"

# Readiness (sglang 0.5.23, srt/entrypoints/http_server.py). /health answers 503 while the
# server's status is Starting (:735-736), and after that runs a one-token generation and
# sleeps a second before it looks for the token (:750-784): never under a second. The
# status turns Up only once the server's own warm-up, an 8-token /generate, was answered
# 200 (`_execute_server_warmup`, :2490-2502; a failed warm-up kills the server,
# :2531-2535), and /ready is 200 exactly while the status is Up and nothing paused it
# (:714-718, managers/tokenizer_manager.py:729-735). So /ready turning 200 proves a
# generation was answered, at once: readiness polls it and sends no generation of its own,
# unless the warm-up is turned off (then the status turns Up without one, :2589-2593).
READINESS_PATH = READY_PATH
WARMUP_OFF_FLAG = "--skip-server-warmup"


def sampling_params(
    max_new_tokens: int = 128,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    stop_token_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
    seed: int | None = None,
) -> dict[str, Any]:
    """SGLang sampling params, only keys SGLang 0.5.23 knows (sglang/api/v1/api_types.py:1256);
    vLLM's request is built from the same dict."""
    params: dict[str, Any] = {
        "max_new_tokens": int(max_new_tokens),
        "temperature": float(temperature),
        "top_p": float(top_p),
        "top_k": int(top_k),
        "stop_token_ids": [int(t) for t in stop_token_ids or ()],
    }
    if ignore_eos:
        params["ignore_eos"] = True
    if seed is not None:
        params["sampling_seed"] = int(seed)
    return params


def generate_request(
    prompt: list[int], sampling: dict, model: str | None = None, with_spans: bool = True
) -> tuple[str, dict]:
    """The /generate request; SGLang needs no model name and always says versions."""
    return "/generate", {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True}


def has_spans(engine_version: tuple[int, ...] | None) -> bool:
    """Whether completions carry per-position weight versions: every reply says them."""
    return True


def first_request(engine_args: Sequence[str] = ()) -> tuple[str, dict] | None:
    """The one tiny generation readiness sends after READINESS_PATH answers, or None where
    that answer already proves one (see READINESS_PATH). Token id 0 is in every vocabulary."""
    if WARMUP_OFF_FLAG not in engine_args:
        return None
    return generate_request([0], sampling_params(max_new_tokens=1, temperature=0.0))


def parse_completion(data: Any, addr: str, known_version: str | None) -> Completion:
    """A /generate reply; finish_reason "abort" (a pause in abort mode, an /abort_request or a
    shutdown) is the caller's to retry."""
    if isinstance(data, list):  # batched form of the same endpoint
        data = data[0]
    meta = data.get("meta_info") or {}
    reason = meta.get("finish_reason")
    if isinstance(reason, dict):
        reason = reason.get("type")
    if reason == "abort":
        return Completion([], [], "abort", known_version, addr)
    token_logprobs = meta.get("output_token_logprobs") or []
    output_ids = data.get("output_ids")
    if output_ids is None:
        output_ids = [entry[1] for entry in token_logprobs]
    logprobs = [entry[0] for entry in token_logprobs]
    if None in logprobs:
        logprobs = [0.0 if lp is None else lp for lp in logprobs]
    # Some versions return prompt+output in output_ids; the logprobs are output only.
    if len(output_ids) > len(logprobs) and token_logprobs:
        output_ids = output_ids[-len(logprobs) :]
    version = meta.get("weight_version", known_version)
    return Completion(
        output_ids=output_ids,
        logprobs=logprobs,
        finish_reason=str(reason or "unknown"),
        weight_version=None if version is None else str(version),
        server=addr,
        text=data.get("text"),
        weight_versions=spans(meta.get("weight_versions")),
    )


def pause_request(mode: str) -> tuple[str, dict, dict | None]:
    """(path, body, query) of a pause (sglang/srt/entrypoints/http_server.py:1831-1841)."""
    return "/pause_generation", {"mode": mode}, None


def disk_update_requests(
    path: str, version: str | None, abort_all_requests: bool
) -> list[tuple[str, dict]]:
    """UpdateWeightFromDiskReqInput (sglang/srt/managers/io_struct.py:1970-1993): the version
    moves only when the request names one."""
    payload: dict[str, Any] = {"model_path": path, "abort_all_requests": abort_all_requests}
    if version is not None:
        payload["weight_version"] = version
    return [("/update_weights_from_disk", payload)]


def parse_version(data: Any) -> str | None:
    if isinstance(data, dict):
        return version_str(data.get("weight_version", data.get("version")))
    return version_str(data)


def parse_model_info(data: Any) -> dict[str, Any]:
    return data


def parse_server_info(data: Any) -> dict[str, Any]:
    return data


def parse_paused_info(data: Any) -> bool | None:
    """The hf server's /server_info pause flag; None where it has none (SGLang)."""
    if isinstance(data, dict):
        flag = (data.get("batching") or {}).get("paused")
        if isinstance(flag, bool):
            return flag
    return None
