"""A collective under a data-dependent branch: `reduce_mean(num_pos)` runs only where the batch
has positive samples; the rank without any goes on to fetch its next batch.

Source: https://github.com/open-mmlab/mmdetection/issues/4724 ("This blocking call is under if
statement. If in some processes this condition is True and in others it is False they are going
to wait indefinitely")
"""
# expect: {"nproc": 3, "kind": "mismatched_collective", "odd_ranks": [2]}

import queue

import _scenario as sc
import torch
import torch.distributed as dist

prefetched: queue.Queue = queue.Queue()


def reduce_mean(t):
    dist.all_reduce(t.div_(sc.WORLD_SIZE))
    return t


def loss_step(num_pos):
    if num_pos > 0:
        sc.ready_when_in("all_reduce")
        reduce_mean(torch.tensor([float(num_pos)]))


def next_batch():
    return prefetched.get()


sc.self_destruct()
sc.init_gloo()
loss_step(num_pos=0 if sc.RANK == 2 else 5)
sc.ready_when_in("next_batch")
next_batch()
