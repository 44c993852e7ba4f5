"""FSDP2 hang: the last rank stalls before forward (STALL=forward: the others wait in the
all-gather that unshards the parameters) or before backward (STALL=backward: the others wait in
the reduce-scatter of the gradients; parameters stay unsharded after forward, so backward
gathers nothing first)."""

import os
import threading

import _scenario as sc
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

STALL = os.environ.get("STALL", "forward")
WAITS_IN = {"forward": "all_gather_single", "backward": "reduce_scatter_single"}


def stall():
    threading.Event().wait()


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, reshard_after_forward=STALL == "forward")
    fully_shard(model, reshard_after_forward=STALL == "forward")
    return model


def train_step(model, batch):
    last = sc.RANK == sc.WORLD_SIZE - 1
    if not last:
        sc.ready_when_in(WAITS_IN[STALL])
    elif STALL == "forward":
        sc.ready_when_in("stall")
        stall()
    loss = model(batch).sum()
    if last and STALL == "backward":
        sc.ready_when_in("stall")
        stall()
    loss.backward()


sc.self_destruct()
sc.init_gloo()
train_step(build(), torch.ones(2, 8))
