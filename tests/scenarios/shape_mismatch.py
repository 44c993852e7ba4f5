"""shape_mismatch: rank 1's tensor is twice the size of rank 0's in one all_reduce (8 MiB
against 4 MiB). On gloo, sizes that are whole multiples of 1 MiB hang rather than abort (at
two ranks; three abort): rank 1 waits in that all_reduce (collective 2) forever, rank 0
returns with wrong data and waits in the next one (collective 3). The stacks show both ranks
in an all_reduce; only the flight recorder shows the sizes. The ranks run on areal's worker
runtime, so the doctor can ask them for the recorder's dump."""

import _scenario as sc
import torch
import torch.distributed as dist

from areal_cli.worker import connect

MIB = 1024 * 1024 // 4  # float32 elements in one MiB


def train_step(ctx):
    grads = torch.ones((8 if sc.RANK == 1 else 4) * MIB)
    dist.all_reduce(grads)
    loss = torch.ones(4)
    dist.all_reduce(loss)
    ctx.progress(1)


sc.self_destruct()
ctx = connect()
dist.all_reduce(torch.ones(4))
ctx.progress(0)
sc.ready_when_in("all_reduce")
train_step(ctx)
