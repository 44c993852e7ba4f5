"""straggler: the last rank spins in a Python loop while the others wait in all_reduce."""

import _scenario as sc
import torch
import torch.distributed as dist


def compute_loss():
    x = 0
    while True:
        x += 1


def sync_grads(t):
    dist.all_reduce(t)


sc.self_destruct()
sc.init_gloo()
if sc.RANK == sc.WORLD_SIZE - 1:
    sc.wait_for_go()
    sc.ready_when_in("compute_loss")
    compute_loss()
else:
    sc.ready_when_in("all_reduce")
    sync_grads(torch.ones(8))
