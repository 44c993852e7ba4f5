"""Two ranks in the same all_reduce over different process groups, for trying the doctor:
their stacks look alike; torch's flight recorder (on in every `areal train` job) shows rank 0
waiting in group `dp` and rank 1 in group `tp`.

    areal train --alloc fsdp:d2 --servers none --detach -- -m areal_cli.templates.examples.wrong_group
    areal doctor hang --job default/trial0   # verdict wrong_group
    areal stop default/trial0
"""

import torch
import torch.distributed as dist

from areal_cli.worker import connect


def train_step(group):
    dist.all_reduce(torch.ones(4), group=group)


ctx = connect()
dp = dist.new_group([0, 1], group_desc="dp")
tp = dist.new_group([0, 1], group_desc="tp")
dist.all_reduce(torch.ones(4))
ctx.progress(0)
train_step(tp if ctx.rank == 1 else dp)
