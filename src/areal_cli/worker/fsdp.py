"""FSDP2 sharding for Hugging Face causal LMs: one FSDP unit per transformer block, plus the root."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from areal_cli.errors import UsageError
from areal_cli.parallel import fsdp_mesh
from areal_cli.worker import consistency

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

# Where common architectures keep their list of transformer blocks.
_BLOCK_PATHS = ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers")


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    for path in _BLOCK_PATHS:
        obj: Any = model
        for attr in path.split("."):
            obj = getattr(obj, attr, None)
            if obj is None:
                break
        if obj is not None:
            return list(obj)
    raise UsageError(
        f"cannot find the transformer blocks of {type(model).__name__}",
        hint=f"shard_model looks for one of: {', '.join(_BLOCK_PATHS)}",
    )


def shard_model(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
) -> torch.nn.Module:
    """`fully_shard` every transformer block and then the root, over the mesh's dp dimension
    (dp and cp flattened into dp_cp when the mesh has cp; see areal_cli.parallel).

    Blocks first, so each block's parameters are gathered just before it runs and freed
    after; the root unit then holds what is left (embeddings, final norm, output head), which
    keeps tied embeddings in one unit. Returns the same module, now sharded in place.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {
        "mesh": fsdp_mesh(mesh),
        "reshard_after_forward": reshard_after_forward,
    }
    if param_dtype is not None or reduce_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=reduce_dtype
        )
    for block in transformer_blocks(model):
        fully_shard(block, **kwargs)
    # The root's parameters are needed again right after forward (output head, backward),
    # so resharding them would only gather them twice.
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})
    consistency.watch(model)  # what `areal doctor diverge` checks, unless told otherwise
    return model
