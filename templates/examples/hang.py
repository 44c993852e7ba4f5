"""A job that hangs, for trying the doctor: the last rank skips an all_reduce that the others
wait in (a rank that took another branch), so nothing moves.

    areal train --alloc fsdp:d2 --servers none --detach -- -m areal_cli.templates.examples.hang
    areal doctor hang --job default/trial0   # verdict mismatched_collective, the odd rank named
    areal stop default/trial0
"""

import threading

import torch
import torch.distributed as dist

from areal_cli.worker import connect


def wait_for_signal():
    threading.Event().wait()  # a signal that never comes


def train_step(ctx, grads):
    if ctx.rank == ctx.world_size - 1:
        wait_for_signal()
    else:
        dist.all_reduce(grads)


ctx = connect()
train_step(ctx, torch.ones(8))
