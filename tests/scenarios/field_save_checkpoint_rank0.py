"""`save_checkpoint` called on rank 0 only; it ends in a barrier. The other ranks went on to
the next step, whose forward waits in DDP's broadcast of its rebuilt bucket order, issued from
C++ (their Python stacks show no collective).

Source: https://github.com/deepspeedai/DeepSpeed/pull/801 ("all processes must call this
method - and I unknowingly called it for rank 0 and was getting a hanging")
"""
# expect: {"nproc": 3, "kind": "collective_type_mismatch", "odd_ranks": [0]}

import _scenario as sc
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def save_checkpoint(model, path):
    torch.save(model.state_dict(), path)
    dist.barrier()  # every rank must reach this


def train_step(model):
    model(torch.ones(2, 8)).sum().backward()


sc.self_destruct()
sc.init_gloo()
torch.manual_seed(0)
model = DDP(nn.Linear(8, 8))
train_step(model)
if sc.RANK == 0:
    sc.ready_when_in("barrier")
    save_checkpoint(model, sc.workdir() / "ckpt.pt")
# DDP's second forward broadcasts its rebuilt bucket order from C++: the others wait there.
sc.ready_when_in("_pre_forward")
train_step(model)
