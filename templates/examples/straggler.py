"""A straggler, for trying the doctor: the last rank computes forever while the others wait
for it in all_reduce. Its stack moves and theirs does not.

    areal train --alloc fsdp:d2 --servers none --detach -- -m areal_cli.templates.examples.straggler
    areal doctor hang --job default/trial0   # verdict straggler, the busy rank named
    areal stop default/trial0
"""

import os

import torch
import torch.distributed as dist

from areal_cli.worker import connect


def compute_loss():
    x = 0
    while True:  # a loss that never finishes: one core busy until the job is stopped
        x += 1


ctx = connect()
if ctx.rank == ctx.world_size - 1:
    os.nice(10)  # the spinning rank yields to everything else on the host
    compute_loss()
else:
    dist.all_reduce(torch.ones(8))
