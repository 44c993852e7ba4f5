"""wrong_group: two process groups over the same ranks; rank 1 all_reduces over the other one.
Both ranks wait in an all_reduce of the same size at the same line, so their stacks look alike;
the flight recorder shows rank 0 waiting in group `dp` and rank 1 in group `tp`. The ranks run on
areal's worker runtime, so the doctor can ask them for the recorder's dump."""

import _scenario as sc
import torch
import torch.distributed as dist

from areal_cli.worker import connect


def train_step(group):
    dist.all_reduce(torch.ones(4), group=group)


sc.self_destruct()
ctx = connect()
dp = dist.new_group([0, 1], group_desc="dp")
tp = dist.new_group([0, 1], group_desc="tp")
dist.all_reduce(torch.ones(4))
ctx.progress(0)
sc.ready_when_in("all_reduce")
train_step(tp if sc.RANK == 1 else dp)
