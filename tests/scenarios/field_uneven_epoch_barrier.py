"""Sample files not divisible by the ranks: the last rank has one step fewer per epoch and
reaches the end-of-epoch barrier while the others all-reduce their last step's loss.

Source: https://github.com/argonne-lcf/dlio_benchmark/pull/339 ("number of training steps will
be one off for one of the ranks, causing barrier deadlock, due to early exit from the loop")
"""
# expect: {"nproc": 3, "kind": "collective_type_mismatch", "odd_ranks": [2]}

import _scenario as sc
import torch
import torch.distributed as dist


def train_epoch(steps):
    for i in range(steps):
        if i == steps - 1 and sc.RANK != 2:
            sc.ready_when_in("all_reduce")
        dist.all_reduce(torch.tensor([1.0]))


sc.self_destruct()
sc.init_gloo()
train_epoch(steps=2 if sc.RANK == 2 else 3)
if sc.RANK == 2:
    sc.ready_when_in("barrier")
dist.barrier()
