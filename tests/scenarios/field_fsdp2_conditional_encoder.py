"""A sharded sub-module that not every rank runs: ranks with a second input run the FSDP2 encoder
(its forward all-gathers the parameters); the rank without one skips it and waits for its next
batch.

Source: https://github.com/pytorch/pytorch/issues/148334 ("the code will hang when trying to
gather the shard for a layer in the encoder because some ranks will not run the encoder")
"""
# expect: {"nproc": 3, "kind": "mismatched_collective", "odd_ranks": [2]}

import queue

import _scenario as sc
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

batches: queue.Queue = queue.Queue()


def next_batch():
    return batches.get()


def step(encoder, x0, x1):
    if x1 is not None:
        x0 = x0 + encoder(x1)
    return x0.sum()


sc.self_destruct()
sc.init_gloo()
torch.manual_seed(0)
encoder = fully_shard(nn.Linear(8, 8))
x1 = None if sc.RANK == 2 else torch.ones(2, 8)
if x1 is not None:
    sc.ready_when_in("all_gather_single")
step(encoder, torch.ones(2, 8), x1)
sc.ready_when_in("next_batch")
next_batch()
