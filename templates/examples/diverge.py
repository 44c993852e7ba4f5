"""Ranks that should agree and do not, for trying the doctor: rank 1's copy of a replicated
weight is off by 0.5, and so are its gradients and loss. The job keeps stepping.

    areal train --alloc fsdp:d2 --servers none --detach -- -m areal_cli.templates.examples.diverge
    areal doctor diverge --job default/trial0   # names weight and rank 1
    areal stop default/trial0
"""

import time

import torch
import torch.distributed as dist
from torch import nn

from areal_cli.worker import connect, watch

ctx = connect()
torch.manual_seed(0)
model = nn.Linear(8, 8)
if ctx.rank == 1:
    with torch.no_grad():
        model.weight[2, 3] += 0.5  # a rank that loaded another checkpoint, say
model(torch.ones(4, 8)).square().sum().backward()
watch(model)  # what `areal doctor diverge` compares
step = 0
while True:
    dist.all_reduce(torch.ones(1))
    ctx.progress(step)
    step += 1
    time.sleep(0.05)
