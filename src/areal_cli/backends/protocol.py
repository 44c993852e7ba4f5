"""Each engine's wire protocol, as pure data: routes, request bodies, reply parsers.

One module per protocol (`protocol_sglang`, spoken by SGLang and by areal's `hf` server;
`protocol_vllm`), each exposing the same names, picked with `backends.protocol_for`. They build and
read what goes over HTTP and nothing else: the pool, failover and timeouts live in
`worker/rollout.py`, the stdlib calls of a teardown in `control.py`. Stdlib only, so the
CLI's start-up path (`areal ps`, discovery) can use them without aiohttp or torch.

Besides routes and parsers, each names `sampling_params` (the sampling dict its requests are
built from), `has_spans(engine_version)` (whether completions carry weight-version spans), and
`WEIGHT_SYNC`, the module of its distributed weight-sync steps (backends/weight_sync.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Completion:
    """One sampled continuation: tokens, the behaviour policy's logprobs, and provenance."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: str | None
    server: str
    text: str | None = None
    # [(version, start, end)] over output positions when the weights changed mid-request
    # (a retracted request that continued after a weight update); None when unknown.
    weight_versions: list[tuple[str, int, int]] | None = None


# The weight version every engine starts at and keeps until a weight update names another
# (SGLang 0.5.23 srt/arg_groups/fields/serving.py:172-175, vLLM 0.32 v1/engine/core.py:141,
# the hf server's batcher).
INITIAL_VERSION = "default"


def version_str(value: Any) -> str | None:
    return None if value is None else str(value)


def spans(raw: Any) -> list[tuple[str, int, int]] | None:
    if not raw:
        return None
    try:
        return [(str(s["version"]), int(s["start"]), int(s["end"])) for s in raw]
    except (KeyError, TypeError, ValueError):
        return None


def version_tuple(raw: Any) -> tuple[int, ...] | None:
    """ "0.32.0", "0.33.1rc2.dev5+gabc" -> (0, 32), (0, 33); None for anything else."""
    parts = []
    for piece in str(raw or "").split(".")[:2]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            return None
        parts.append(int(digits))
    return tuple(parts) if len(parts) == 2 else None
