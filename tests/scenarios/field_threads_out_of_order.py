"""Two threads of each rank issue collectives on one process group: the main thread all-reduces
the gradients, a communication thread all-gathers. On the last rank the communication thread
issues first. c10d numbers a group's collectives in the order they are issued, so collective N
is an all_reduce on some ranks and an all_gather on the others. Every rank's stacks look alike
(both threads wait, in the same functions); the flight recorder shows the different ops at one
number. The ranks run on areal's worker runtime, so the doctor can ask them for the recorder.

Source: https://github.com/pytorch/pytorch/issues/175145 (collectives issued from separate
Python threads deadlock)
"""
# expect: {"nproc": 3, "kind": "collective_type_mismatch", "odd_ranks": [2]}

import threading

import _scenario as sc
import torch
import torch.distributed as dist

from areal_cli.worker import connect

first_issued = threading.Event()
comm_first = sc.RANK == sc.WORLD_SIZE - 1


def sync_grads():
    if comm_first:
        first_issued.wait()
    work = dist.all_reduce(torch.ones(8), async_op=True)
    if not comm_first:
        first_issued.set()
    work.wait()


def gather_stats():
    if not comm_first:
        first_issued.wait()
    work = dist.all_gather_into_tensor(torch.zeros(4 * sc.WORLD_SIZE), torch.ones(4), async_op=True)
    if comm_first:
        first_issued.set()
    sc.touch(f"ready-{sc.RANK}")
    work.wait()


sc.self_destruct()
ctx = connect()
dist.all_reduce(torch.ones(4))
ctx.progress(0)
comm = threading.Thread(target=gather_stats, name="comm", daemon=True)
comm.start()
sync_grads()
