"""slow_rank: every rank computes, then all_reduces, step after step; the last rank's compute
takes three times as long (COMPUTE_S each, 3 x COMPUTE_S on the last rank), so the others wait
for it in all_reduce. The compute sleeps, so the ratio holds however loaded the host is."""

import os
import time

import _scenario as sc
import torch
import torch.distributed as dist

COMPUTE_S = float(os.environ.get("COMPUTE_S", "0.03"))


def compute(seconds):
    time.sleep(seconds)


def sync_grads(t):
    dist.all_reduce(t)


sc.self_destruct()
sc.init_gloo()
t = torch.ones(16)
slow = sc.RANK == sc.WORLD_SIZE - 1
sc.ready_when_in("sync_grads")
while True:
    compute(COMPUTE_S * (3 if slow else 1))
    sync_grads(t)
