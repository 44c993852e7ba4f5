"""A training job for `doctor profile | memory | diverge` on a cluster job (Slurm, Ray): every
rank joins through worker.connect() (the rank table knows its node and pid), steps with a
compute phase and an all_reduce, and reports ctx.progress(step). The last rank computes three
times as long (a straggler: the others wait for it in all_reduce) and holds a weight that
differs by 0.5 from the other ranks' (a replica drifting).

COMPUTE_S per step (0.03); CLUSTER_DOCTOR_LIFETIME: ends itself after that many seconds."""

import os
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

from areal_cli import worker

ctx = worker.connect()
threading.Timer(float(os.environ.get("CLUSTER_DOCTOR_LIFETIME", "300")), os._exit, (3,)).start()
COMPUTE_S = float(os.environ.get("COMPUTE_S", "0.03"))
last = ctx.rank == ctx.world_size - 1

torch.manual_seed(0)
model = nn.Linear(8, 8)
if last:
    with torch.no_grad():
        model.weight[2, 3] += 0.5
worker.watch(model)


def compute(seconds):
    time.sleep(seconds)  # sleeps: the ratio holds however loaded the host is


def sync_grads(t):
    dist.all_reduce(t)


print(f"rank {ctx.rank} of {ctx.world_size} ready", flush=True)
t = torch.ones(16)
step = 0
while True:
    compute(COMPUTE_S * (3 if last else 1))
    sync_grads(t)
    ctx.progress(step)
    step += 1
