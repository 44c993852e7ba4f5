"""Before the first rollout: the servers must hold the weights the trainer starts from.

A trainer restarted against servers that an earlier run updated would otherwise sample its
first batches from other weights (off-policy from step 0): the servers keep whatever the
last sync left, and SGLang even moves its /model_info `model_path` to the last checkpoint
it loaded from disk (managers/tokenizer_manager.py:2365), so a trainer that loads that path
and a server that got later weights over the network disagree without a sign.

Every engine starts at weight version "default" (SGLang 0.5.23 srt/arg_groups/fields/
serving.py:172-175, vLLM 0.32 v1/engine/core.py:141, our hf server's batcher) and changes it
only when told to. A server that reports "default" and serves the model path the trainer loaded holds
the trainer's weights; any other server gets them pushed before the first rollout.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from areal_cli.backends.protocol import INITIAL_VERSION
from areal_cli.worker.weights import sync_weights

if TYPE_CHECKING:
    import torch

    from areal_cli.worker.rollout import RolloutClient


def _same_model(a: str | None, b: str | None) -> bool:
    if not a or not b:
        return False
    if os.path.exists(a) and os.path.exists(b):
        return os.path.realpath(a) == os.path.realpath(b)
    return a.rstrip("/") == b.rstrip("/")


def diverged(states: dict[str, dict[str, Any]], model_path: str) -> dict[str, str]:
    """The servers whose weights may not be the trainer's, each with why."""
    out = {}
    for addr, st in states.items():
        version, path = st.get("weight_version"), st.get("model_path")
        if version not in (None, INITIAL_VERSION):
            out[addr] = f"holds weight version {version} (model {path})"
        elif not _same_model(path, model_path):
            out[addr] = f"serves {path}, not {model_path}"
    return out


def align_servers(
    model: torch.nn.Module,
    client: RolloutClient,
    model_path: str,
    *,
    method: str = "distributed",
    path: str | None = None,
    version: str | int = 0,
    **sync_kwargs: Any,
) -> dict[str, Any]:
    """Make every server hold `model`'s weights (loaded from `model_path`) before the first
    rollout. Collective: every rank calls it; rank 0 asks the servers and decides for all.

    Servers still at their initial weights of `model_path` are left as they are; otherwise
    the trainer's weights go to every server with `sync_weights(method=..., path=...,
    version=...)`. Returns {"synced": bool, "diverged": {addr: why}, "version", "method",
    "failed"} on every rank; `describe(result)` is the line to print.
    """
    import torch.distributed as dist

    found: list[Any] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        states = client.run(client.server_states())
        found[0] = diverged(states, model_path)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(found, src=0)
    why = found[0]
    if not why:
        return {"synced": False, "diverged": {}, "version": INITIAL_VERSION, "method": None,
                "failed": {}, "model_path": model_path}  # fmt: skip
    got = sync_weights(model, client, path, method=method, version=version, **sync_kwargs)
    return {"synced": True, "diverged": why, "version": got["version"], "method": method,
            "failed": got["failed"], "model_path": model_path}  # fmt: skip


def describe(result: dict[str, Any]) -> str:
    """One line for the training log: what the servers held and what was done about it."""
    if not result["synced"]:
        return (
            f"servers hold the weights the trainer starts from ({result['model_path']}, "
            f"version {INITIAL_VERSION}): no sync before the first rollout"
        )
    held = "; ".join(f"{a} {w}" for a, w in result["diverged"].items())
    line = (
        f"servers held other weights than the trainer's ({held}): pushed the trainer's "
        f"weights ({result['model_path']}) to them before the first rollout, version "
        f"{result['version']} by {result['method']} sync"
    )
    if result["failed"]:
        line += f"; not reached: {', '.join(result['failed'])} (left out of sampling)"
    return line
