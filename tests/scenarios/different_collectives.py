"""collective_type_mismatch: ranks 0..n-2 wait in all_reduce, the last rank waits in a recv."""

import _scenario as sc
import torch
import torch.distributed as dist


def sync_grads(t):
    sc.ready_when_in("all_reduce")
    dist.all_reduce(t)


def receive_weights(t):
    sc.ready_when_in("recv")
    dist.recv(t, src=0)


sc.self_destruct()
sc.init_gloo()
t = torch.ones(8)
if sc.RANK == sc.WORLD_SIZE - 1:
    receive_weights(t)
else:
    sync_grads(t)
