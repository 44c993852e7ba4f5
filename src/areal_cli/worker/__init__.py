"""What a training script imports: join the job, shard the model, sample, sync weights.

    from areal_cli.worker import connect, shard_model, sync_weights

    ctx = connect()                       # rank, device, mesh, servers from `areal train`
    model = shard_model(model, ctx.mesh)  # FSDP2 over the dp dimension
    client = ctx.rollout_client()
    align_servers(model, client, model_path)  # the servers start from these weights too
    groups = client.run(client.generate_batch(prompts, n=8, max_new_tokens=256))
    ...
    sync_weights(model, client, method="distributed", version=step)   # or method="disk" + a path

    ckpt = Checkpointer(keep=2)           # $AREAL_LOG_DIR/checkpoints unless given a folder
    resumed = ckpt.load(model, optimizer) # the latest whole checkpoint, or None
    ckpt.save(step, model, optimizer, extra={"data_position": pos})   # in the background

Nothing heavy is imported until a name is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from areal_cli.worker.agree import align_servers
    from areal_cli.worker.checkpoint import Checkpoint, Checkpointer, latest
    from areal_cli.worker.consistency import check_consistency, watch
    from areal_cli.worker.fsdp import shard_model, transformer_blocks
    from areal_cli.worker.rollout import Completion, RolloutClient, RolloutError, SyncError
    from areal_cli.worker.runtime import WorkerContext, close, connect
    from areal_cli.worker.weights import full_state_dict, save_hf_checkpoint, sync_weights

_EXPORTS = {
    "align_servers": "agree",
    "Checkpoint": "checkpoint",
    "Checkpointer": "checkpoint",
    "latest": "checkpoint",
    "check_consistency": "consistency",
    "watch": "consistency",
    "connect": "runtime",
    "close": "runtime",
    "WorkerContext": "runtime",
    "RolloutClient": "rollout",
    "Completion": "rollout",
    "RolloutError": "rollout",
    "SyncError": "rollout",
    "shard_model": "fsdp",
    "transformer_blocks": "fsdp",
    "save_hf_checkpoint": "weights",
    "sync_weights": "weights",
    "full_state_dict": "weights",
}

__all__ = [
    "align_servers",
    "check_consistency",
    "Checkpoint",
    "Checkpointer",
    "latest",
    "Completion",
    "RolloutClient",
    "RolloutError",
    "SyncError",
    "WorkerContext",
    "close",
    "connect",
    "full_state_dict",
    "save_hf_checkpoint",
    "shard_model",
    "sync_weights",
    "transformer_blocks",
    "watch",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'areal_cli.worker' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"areal_cli.worker.{module}"), name)
