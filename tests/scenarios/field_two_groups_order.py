"""Collectives on two process groups issued in a rank-dependent order: the last rank all-reduces
on `replicate` first, the others on `shard` first, each from the same helper at the same line.
Their stacks look alike; the flight recorder shows which group each waits in. The ranks run on
areal's worker runtime, so the doctor can ask them for the recorder's dump.

Source: https://github.com/meta-pytorch/torchrec/pull/4149 ("rank-divergent collective ordering
across two process groups ... creating a circular dependency where no rank could make progress")
"""
# expect: {"nproc": 3, "kind": "wrong_group", "odd_ranks": [2]}

import _scenario as sc
import torch
import torch.distributed as dist

from areal_cli.worker import connect


def sync(group):
    dist.all_reduce(torch.ones(4), group=group)


sc.self_destruct()
ctx = connect()
shard = dist.new_group(list(range(sc.WORLD_SIZE)), group_desc="shard")
replicate = dist.new_group(list(range(sc.WORLD_SIZE)), group_desc="replicate")
dist.all_reduce(torch.ones(4))
ctx.progress(0)
sc.ready_when_in("all_reduce")
order = [replicate, shard] if sc.RANK == 2 else [shard, replicate]
for group in order:
    sync(group)
