"""Weight sync through the filesystem: gather the sharded model, write an HF checkpoint, reload.

Every rank calls both functions (the gather is a collective); rank 0 writes the files and
talks to the servers; a barrier at the end means no rank starts sampling before the
servers hold the new weights.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_cli.errors import UsageError

if TYPE_CHECKING:
    import torch

    from areal_cli.worker.rollout import RolloutClient

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# Written from the model itself, never copied from the source checkpoint.
_OWN_FILES = {"config.json"}


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _architecture(model: torch.nn.Module) -> str:
    # FSDP2 swaps the class for a subclass named "FSDP<Name>"; the checkpoint must name the
    # class transformers knows.
    for cls in type(model).__mro__:
        if not cls.__name__.startswith("FSDP"):
            return cls.__name__
    return type(model).__name__


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights as plain CPU tensors (collective: every rank must call).

    Ranks other than 0 get an empty dict: only rank 0 keeps the gathered copy.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if dist.is_initialized():
        state = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    else:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _copy_support_files(source: Path, target: Path) -> list[str]:
    copied = []
    for item in sorted(source.iterdir()):
        if (
            not item.is_file()
            or item.name in _OWN_FILES
            or item.name in _WEIGHT_INDEXES
            or item.suffix in _WEIGHT_SUFFIXES
        ):
            continue
        shutil.copy2(item, target / item.name)
        copied.append(item.name)
    return copied


def save_hf_checkpoint(
    model: torch.nn.Module,
    path: str | Path,
    *,
    tokenizer_from: str | Path | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 1024**3,
) -> Path:
    """Write `model` (sharded with FSDP2 or not) as a Hugging Face checkpoint directory.

    Collective: every rank calls it; rank 0 writes. The directory appears whole or not at
    all (written beside it, then renamed), so a server never loads a half-written
    checkpoint. `tokenizer_from` is the source model directory: its tokenizer, generation
    config and any other non-weight files are copied over. `dtype` casts floating weights
    (e.g. torch.bfloat16 for serving).
    """
    from safetensors.torch import save_file

    target = Path(path).expanduser().resolve()
    state = full_state_dict(model)
    if _rank() == 0:
        config = copy.deepcopy(getattr(model, "config", None))
        if config is None:
            raise UsageError(
                f"{type(model).__name__} has no .config; save_hf_checkpoint needs a "
                "transformers PreTrainedModel"
            )
        if getattr(config, "tie_word_embeddings", False):
            # transformers re-ties the head on load; safetensors refuses shared storage anyway.
            state.pop("lm_head.weight", None)
        tensors: dict[str, torch.Tensor] = {}
        for name, t in state.items():
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            tensors[name] = t.contiguous()

        staging = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
        staging.mkdir(parents=True)
        try:
            if not getattr(config, "architectures", None):
                config.architectures = [_architecture(model)]
            if dtype is not None:
                config.dtype = dtype
            config.save_pretrained(staging)
            _write_safetensors(tensors, staging, max_shard_bytes, save_file)
            if tokenizer_from is not None:
                _copy_support_files(Path(tokenizer_from).expanduser(), staging)
            _replace_dir(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    _barrier()
    return target


def _write_safetensors(tensors, out: Path, max_shard_bytes: int, save_file) -> None:
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _replace_dir(staging: Path, target: Path) -> None:
    if target.exists():
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(target, old)
        os.replace(staging, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, target)


def sync_weights(
    model: torch.nn.Module,
    client: RolloutClient,
    path: str | Path,
    *,
    version: str | int | None = None,
    tokenizer_from: str | Path | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Save `model` to `path` and make every inference server load it.

    Collective. Rank 0 pauses the servers, has each load the checkpoint from disk, and
    resumes them; every rank returns {"version", "save_s", "load_s"} once the servers
    report the new version. `client` is only used on rank 0 (other ranks may pass theirs,
    it stays untouched).
    """
    import torch.distributed as dist

    t0 = time.perf_counter()
    target = save_hf_checkpoint(model, path, tokenizer_from=tokenizer_from, dtype=dtype)
    t1 = time.perf_counter()
    result: list[Any] = [None]
    error: Exception | None = None
    if _rank() == 0:
        try:
            result[0] = {"ok": True, "version": client.run(_reload(client, target, version))}
        except Exception as e:  # every rank must learn of it, or the others hang in broadcast
            error = e
            result[0] = {"ok": False, "message": getattr(e, "message", None) or str(e)}
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(result, src=0)
    outcome = result[0]
    if error is not None:
        raise error
    if not outcome["ok"]:
        from areal_cli.worker.rollout import RolloutError

        raise RolloutError(f"weight sync failed on rank 0: {outcome['message']}")
    return {"version": outcome["version"], "save_s": t1 - t0, "load_s": time.perf_counter() - t1}


async def _reload(client: RolloutClient, path: Path, version: str | int | None) -> str | None:
    await client.pause()
    try:
        return await client.update_weights_from_disk(str(path), version=version)
    finally:
        await client.resume()
