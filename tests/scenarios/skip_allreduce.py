"""mismatched_collective: the last rank skips an all_reduce and waits for a signal that never
comes; the others wait in the all_reduce."""

import threading

import _scenario as sc
import torch
import torch.distributed as dist


def wait_for_signal():
    threading.Event().wait()


def train_step(t):
    if sc.RANK == sc.WORLD_SIZE - 1:
        sc.ready_when_in("wait_for_signal")
        wait_for_signal()
    else:
        sc.ready_when_in("all_reduce")
        dist.all_reduce(t)


sc.self_destruct()
sc.init_gloo()
train_step(torch.ones(8))
