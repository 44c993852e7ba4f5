"""A rank whose loss is NaN skips backward and the step; DDP's gradient all-reduce runs inside
backward, issued by its reducer from C++, so the other ranks sit in `loss.backward()` with a
Python stack that shows no collective. The skipping rank runs one step fewer and waits in the
end-of-epoch barrier.

Source: https://github.com/ai2cm/ace/pull/850 (a NaN on a subset of ranks: "the other ranks
call torch.backward, which is a collective all reduce, and the other GPUs hang")
"""
# expect: {"nproc": 3, "kind": "collective_type_mismatch", "odd_ranks": [2]}

import _scenario as sc
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def train(model, steps):
    for step in range(steps):
        loss = model(torch.ones(2, 8)).sum()
        if sc.RANK == 2 and step == 1:
            loss = loss * float("nan")
        if not torch.isfinite(loss):
            continue  # skip this batch: only this rank does
        if step == steps - 1:
            sc.ready_when_in("_engine_run_backward")
        loss.backward()


sc.self_destruct()
sc.init_gloo()
torch.manual_seed(0)
train(DDP(nn.Linear(8, 8)), steps=3)
if sc.RANK == 2:
    sc.ready_when_in("barrier")
dist.barrier()
