"""SGLang 0.5.23's HTTP contract, as the hf server enforces it: request decoding, validation
texts and the error and reply shapes. Where the SGLang that AReaL pins (0.5.10.post1) accepts
more, the server accepts it too: a distributed update outside a session (app.py).

Sources (sglang 0.5.23 wheel):
    api/v1/api_types.py              the /generate JSON contract: unknown sampling keys
                                     rejected, serde-style error texts
    srt/sampling/sampling_params.py  normalisation (__post_init__) and verify() texts
    srt/managers/io_struct.py        control request structs (fields, defaults)
    srt/entrypoints/http_server.py   routes, status codes, reply bodies

Three kinds of 400 come out of SGLang's /generate, each with its own body:
    contract violation   {"error": "<serde text>"}                  http_server.py:937-939
    semantic ValueError  {"error": {"message": "<text>"}}           http_server.py:2246-2250
    pydantic validation  {"object": "error", "message", "type": "Bad Request", "param",
                          "code": 400}                               http_server.py:636-698
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

T = TypeVar("T")

# api/v1/api_types.py:1256, in this order: it is part of the error text.
SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
    "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "min_new_tokens", "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval",
    "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)  # fmt: skip

# srt/sampling/sampling_params.py:44 and :245-250: top_k -1 and greedy temperatures.
TOP_K_ALL = 1 << 30
SAMPLING_EPS = 1e-6

# Sampling fields SGLang knows that the hf server does not implement: refused with a 400
# when set to anything but their default, never silently ignored.
_UNSUPPORTED_SAMPLING = {
    "stop_regex": None,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
    "beam_width": None,
    "watermark": None,
    "choice": None,
}
# Top-level /generate fields SGLang knows that the hf server does not implement.
_UNSUPPORTED_GENERATE = (
    "lora_path", "session_params", "kv_hints", "token_ids_logprob", "custom_logit_processor",
    "bootstrap_host", "input_embeds",
)  # fmt: skip
# The media inputs of GenerateReqInput (srt/managers/io_struct.py:200-204, MediaInput in
# api/v1/api_types.py:883-899). SGLang serves a request whose media hold no item (null, [],
# [null], [[null]]) as text only (contains_mm_input -> has_valid_data,
# srt/multimodal/mm_utils.py:53-58; the same in 0.5.10.post1): AReaL's trainer sends
# "image_data": [] with every /generate. Only a real item is refused here.
MEDIA_FIELDS = ("image_data", "video_data", "audio_data")


class ContractError(ValueError):
    """The body breaks the JSON contract: 400 {"error": "<text>"}."""


class RequestError(ValueError):
    """A request SGLang would refuse with a ValueError: 400 {"error": {"message": ...}}."""


# -- serde-style texts (api/v1/api_types.py:30-108) -------------------------------------------


def _unexpected(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    if isinstance(v, list):
        return "sequence"
    if isinstance(v, dict):
        return "map"
    return type(v).__name__


def _invalid(v: Any, expected: str) -> ContractError:
    return ContractError(f"invalid type: {_unexpected(v)}, expected {expected}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _typed(v: Any, ok: bool, expected: str) -> Any:
    """`v` where it has the JSON type expected (`ok`), else the serde error naming both."""
    if ok:
        return v
    raise _invalid(v, expected)


def _int(v: Any) -> int:
    return _typed(v, _is_int(v), "i64")


def _float(v: Any) -> float:
    # A JSON integer stays an int, as in the engine: its messages say "got -1.", not "-1.0."
    return _typed(v, isinstance(v, (int, float)) and not isinstance(v, bool), "f64")


def _bool(v: Any) -> bool:
    return _typed(v, isinstance(v, bool), "a boolean")


def _str(v: Any) -> str:
    return _typed(v, isinstance(v, str), "a string")


def _seq(v: Any) -> list:
    return _typed(v, isinstance(v, list), "a sequence")


def _str_or_list(v: Any, name: str) -> str | list[str]:
    if isinstance(v, list):
        return [_str(e) for e in v]
    if isinstance(v, str):
        return v
    raise _invalid(v, f"a value or an array of values for {name}")


def _unknown_field(key: str) -> ContractError:
    listed = ", ".join(f"`{f}`" for f in SAMPLING_FIELDS)
    return ContractError(f"unknown field `{key}`, expected one of {listed}")


def decode_sampling(value: Any) -> dict[str, Any]:
    """api_types.py:1259-1320: a JSON object of known keys with JSON types; null = default."""
    if not isinstance(value, dict):
        raise _invalid(value, "struct SamplingParams")
    out: dict[str, Any] = {}
    for key, x in value.items():
        if key not in SAMPLING_FIELDS:
            raise _unknown_field(key)
        if x is None:
            out[key] = None
        elif key in ("max_new_tokens", "top_k", "min_new_tokens", "n", "stream_interval",
                     "sampling_seed", "beam_width"):  # fmt: skip
            out[key] = _int(x)
        elif key in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):  # fmt: skip
            out[key] = _float(x)
        elif key in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "no_stop_trim"):  # fmt: skip
            out[key] = _bool(x)
        elif key in ("stop", "stop_regex"):
            out[key] = _str_or_list(x, "StringOrList")
        elif key == "stop_token_ids":
            out[key] = [_int(e) for e in _seq(x)]
        elif key in ("json_schema", "regex", "ebnf", "structural_tag"):
            out[key] = _str(x)
        elif key == "logit_bias":
            if not isinstance(x, dict):
                raise _invalid(x, "a map")
            out[key] = {k: _float(e) for k, e in x.items()}
        elif key == "choice":
            out[key] = [_str(e) for e in _seq(x)]
        else:  # custom_params, watermark: passed through
            out[key] = x
    return out


def _bool_or_list(v: Any) -> Any:
    return [_bool(e) for e in v] if isinstance(v, list) else _bool(v)


def _int_or_list(v: Any) -> Any:
    return [_int(e) for e in v] if isinstance(v, list) else _int(v)


def _token_ids_or_list(v: Any) -> list:
    if not isinstance(v, list):
        raise _invalid(v, "a value or an array of values for TokenIdsOrList")
    # api_types.py:1029-1035: [] and [scalar, ...] are one flat list; anything else a batch.
    if not v or (isinstance(v[0], (int, float)) and not isinstance(v[0], bool)):
        return [_int(e) for e in v]
    return [[_int(e) for e in _seq(row)] for row in v]


@dataclass
class GenerateBody:
    """A /generate body after the contract check (api_types.py:236-278, unknown keys ignored)."""

    text: Any = None
    input_ids: Any = None
    rid: Any = None
    stream: bool = False
    sampling_params: Any = None
    return_logprob: Any = None
    logprob_start_len: Any = None
    top_logprobs_num: Any = None
    return_text_in_logprobs: bool = False
    unsupported: list[str] = field(default_factory=list)


def decode_generate(body: Any) -> GenerateBody:
    if not isinstance(body, dict):
        raise _invalid(body, "struct GenerateRequest")
    g = GenerateBody()
    for key, x in body.items():
        if x is None:
            continue
        if key in ("text", "rid"):
            setattr(g, key, _str_or_list(x, "StringOrList"))
        elif key == "input_ids":
            g.input_ids = _token_ids_or_list(x)
        elif key == "stream":
            g.stream = _bool(x)
        elif key == "sampling_params":
            g.sampling_params = (
                [decode_sampling(e) for e in x] if isinstance(x, list) else decode_sampling(x)
            )
        elif key == "return_logprob":
            g.return_logprob = _bool_or_list(x)
        elif key in ("logprob_start_len", "top_logprobs_num"):
            setattr(g, key, _int_or_list(x))
        elif key == "return_text_in_logprobs":
            g.return_text_in_logprobs = _bool(x)
        elif key in MEDIA_FIELDS:
            if has_media(_media_input(x)):
                g.unsupported.append(key)
        elif key in _UNSUPPORTED_GENERATE:
            g.unsupported.append(key)
    return g


def _media_item(v: Any) -> Any:
    # api_types.py:1986-1991: a string (path, URL, base64) or a {"url": ...}-style map.
    if isinstance(v, (str, dict)):
        return v
    raise _invalid(v, "one of the MediaItem shapes")


def _media_items(v: Any) -> list:
    return [None if e is None else _media_item(e) for e in _seq(v)]


def _media_input(v: Any) -> Any:
    """api_types.py:2034-2043: one item, a list of items or a list of lists (the first
    element's shape picks the arm); nulls stand for "no item"."""
    if isinstance(v, list):
        if v and isinstance(v[0], list):
            return [None if e is None else _media_items(e) for e in v]
        return _media_items(v)
    if isinstance(v, (str, dict)):
        return v
    raise _invalid(v, "one of the MediaInput shapes")


def has_media(v: Any) -> bool:
    """SGLang's has_valid_data (srt/multimodal/mm_utils.py:53-58): any item that is not null,
    at any depth."""
    if v is None:
        return False
    if isinstance(v, list):
        return any(has_media(e) for e in v)
    return True


# -- SGLang's SamplingParams semantics (srt/sampling/sampling_params.py:140-330) ---------------


@dataclass
class Sampling:
    """Normalised sampling parameters of one request."""

    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: set[int] = field(default_factory=set)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.top_k == 1


def sampling_from(d: dict[str, Any] | None, vocab_size: int) -> Sampling:
    """Normalise as __post_init__ does (:205-250), then verify() (:252-330); texts verbatim."""
    d = dict(d or {})
    for key, default in _UNSUPPORTED_SAMPLING.items():
        value = d.get(key)
        if value is not None and value != default and value != {} and value != []:
            raise RequestError(f"the hf server does not support sampling_params.{key}")
    s = Sampling()
    if "max_new_tokens" in d:
        s.max_new_tokens = d["max_new_tokens"]
    s.temperature = 1.0 if d.get("temperature") is None else d["temperature"]
    s.top_p = 1.0 if d.get("top_p") is None else d["top_p"]
    s.top_k = -1 if d.get("top_k") is None else d["top_k"]
    s.min_p = 0.0 if d.get("min_p") is None else d["min_p"]
    stop = d.get("stop")
    s.stop = [stop] if isinstance(stop, str) else list(stop or [])
    s.stop_token_ids = {int(t) for t in d.get("stop_token_ids") or [] if t is not None}
    s.ignore_eos = bool(d.get("ignore_eos") or False)
    skip = d.get("skip_special_tokens")
    s.skip_special_tokens = True if skip is None else skip
    s.no_stop_trim = bool(d.get("no_stop_trim") or False)
    s.sampling_seed = d.get("sampling_seed")
    if 0 <= s.temperature < SAMPLING_EPS:  # top_k = 1 means greedy sampling
        s.temperature = 1.0
        s.top_k = 1
    if s.top_k == -1:
        s.top_k = TOP_K_ALL
    _verify(s, vocab_size)
    return s


def _verify(s: Sampling, vocab_size: int) -> None:
    if not math.isfinite(s.temperature) or s.temperature < 0.0:
        raise RequestError(
            f"temperature must be a non-negative finite number, got {s.temperature}."
        )
    if not 0.0 < s.top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {s.top_p}.")
    if not 0.0 <= s.min_p <= 1.0:
        raise RequestError(f"min_p must be in [0, 1], got {s.min_p}.")
    if s.top_k < 1 or s.top_k == -1:
        raise RequestError(f"top_k must be -1 (disable) or at least 1, got {s.top_k}.")
    if s.max_new_tokens is not None and s.max_new_tokens < 0:
        raise RequestError(f"max_new_tokens must be at least 0, got {s.max_new_tokens}.")
    if s.sampling_seed is not None and not -(2**63) <= s.sampling_seed <= 2**63 - 1:
        raise RequestError(f"sampling_seed must be in [-2**63, 2**63 - 1], got {s.sampling_seed}.")


# -- reply bodies -------------------------------------------------------------------------------


def finish_abort(message: str = "Aborted") -> dict[str, Any]:
    """FINISH_ABORT.to_json() (srt/managers/schedule_batch.py:332-345)."""
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


def validation_error(message: str) -> dict[str, Any]:
    """The ErrorResponse body of a pydantic validation failure (http_server.py:691-698)."""
    return {"object": "error", "message": message, "type": "Bad Request", "param": None,
            "code": 400}  # fmt: skip


# http_server.py:1025-1040: /flush_cache answers text, not JSON.
FLUSH_OK = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
FLUSH_FAILED = "Flush cache failed.\n"
# srt/managers/scheduler_components/weight_updater.py:120-135
FLUSH_AFTER_UPDATE_FAILED = (
    "Weights were updated, but the cache was not flushed because requests are still running "
    "or queued. Retract or finish them, then call /flush_cache."
)


# -- control request bodies ------------------------------------------------------------------
#
# SGLang validates these with pydantic in lax mode, through FastAPI: in 0.5.10.post1 the
# request structs are dataclasses (srt/managers/io_struct.py, BaseReq :50-52), in 0.5.23
# msgspec structs whose pydantic schema is built from the same field types
# (srt/utils/msgspec_utils.py:70-118, BaseReq io_struct.py:86-94; unknown keys ignored).
# The same field types validated by pydantic here give the same coercions: a port sent as
# "29500" (AReaL sends str(port)) is the int 29500, a version sent as 8 is refused.


class BodyError(ValueError):
    """A control body that FastAPI's validation refuses: 400 ErrorResponse."""


Selector = Literal["target", "draft", "all"]


@dataclass(kw_only=True)
class PauseGenerationReq:  # io_struct.py:1927-1946
    mode: Literal["abort", "retract", "in_place"] = "abort"


@dataclass(kw_only=True)
class AbortReq:  # io_struct.py:2285-2296 (rid from BaseReq; None means "")
    rid: str | None = None
    abort_all: bool = False


@dataclass(kw_only=True)
class UpdateWeightFromDiskReq:  # io_struct.py:1970-1993
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


@dataclass(kw_only=True)
class UpdateWeightVersionReq:  # io_struct.py:2155-2159
    new_version: str
    abort_all_requests: bool = True


@dataclass(kw_only=True)
class InitWeightsUpdateGroupReq:  # io_struct.py:2126-2138; 0.5.10.post1 :1377-1389
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


@dataclass(kw_only=True)
class DestroyWeightsUpdateGroupReq:  # io_struct.py:2146-2147
    group_name: str = "weight_update_group"


@dataclass(kw_only=True)
class BeginWeightUpdateReq:  # io_struct.py:2197-2200
    selector: Selector = "all"


@dataclass(kw_only=True)
class UpdateWeightsFromDistributedReq:  # io_struct.py:2002-2019; 0.5.10.post1 :1258-1271
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Selector = "all"


_ADAPTERS: dict[type, Any] = {}


def parse_body(cls: type[T], body: dict[str, Any]) -> T:
    """`body` validated as SGLang validates its request struct, or BodyError naming each
    refused field as pydantic does."""
    from pydantic import TypeAdapter, ValidationError

    adapter = _ADAPTERS.get(cls)
    if adapter is None:
        adapter = _ADAPTERS[cls] = TypeAdapter(cls)
    try:
        return adapter.validate_python(body)
    except ValidationError as e:
        raise BodyError(
            "; ".join(f"{err['msg']}: {'.'.join(map(str, err['loc']))}" for err in e.errors())
        ) from None
