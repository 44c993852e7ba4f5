"""A training step that returns early on an invalid loss skips the all_gather of the frame count
the other ranks do; the skipping rank goes on to clip the gradient norm across ranks.

Source: https://github.com/pytorch/audio/issues/3749 ("if NaN occurs in a specific GPU process,
it never reaches this all_gather, causing the training to stall")
"""
# expect: {"nproc": 3, "kind": "collective_type_mismatch", "odd_ranks": [2]}

import _scenario as sc
import torch
import torch.distributed as dist


def training_step():
    loss = torch.tensor(float("nan") if sc.RANK == 2 else 1.0)
    if torch.isnan(loss):
        return None
    num_frame = torch.tensor([100.0])
    frames = [torch.zeros(1) for _ in range(sc.WORLD_SIZE)]
    sc.ready_when_in("all_gather")
    dist.all_gather(frames, num_frame)
    return loss


def clip_grad_norm():
    norm = torch.tensor([1.0])
    sc.ready_when_in("all_reduce")
    dist.all_reduce(norm)


sc.self_destruct()
sc.init_gloo()
training_step()
clip_grad_norm()
