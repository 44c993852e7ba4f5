"""A training job that hangs on purpose (for the doctor on Slurm): the last rank skips an
all_reduce and waits for a signal that never comes; the others wait in the all_reduce. Every
rank joins through worker.connect(), so the registry's rank table knows its node and pid.
SLURM_HANG_LOOP=1: all ranks all_reduce in a loop instead (a healthy job)."""

import os
import threading
import time

import torch
import torch.distributed as dist

from areal_cli import worker

ctx = worker.connect()
# Ends itself even if its test's teardown never ran.
threading.Timer(float(os.environ.get("SLURM_HANG_LIFETIME", "300")), os._exit, (3,)).start()


def wait_for_signal():
    threading.Event().wait()


def train_step(t):
    if ctx.rank == ctx.world_size - 1 and not os.environ.get("SLURM_HANG_LOOP"):
        print(f"rank {ctx.rank} skips the all_reduce", flush=True)
        wait_for_signal()
    else:
        dist.all_reduce(t)


print(f"rank {ctx.rank} of {ctx.world_size} on {os.environ.get('SLURMD_NODENAME')}", flush=True)
while True:
    train_step(torch.ones(4))
    time.sleep(0.05)
