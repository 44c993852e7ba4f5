"""Resuming: each rank checks on its own whether the state file exists; on a distributed file
system one rank sees no file, skips the `broadcast_object_list` of the loaded state and goes on
to its first step's gradient all-reduce.

Source: https://github.com/KempnerInstitute/KempnerForge/issues/49 ("some ranks enter the
torch.load branch and others skip it, then the following broadcast_object_list deadlocks")
"""
# expect: {"nproc": 3, "kind": "collective_type_mismatch", "odd_ranks": [2]}

import _scenario as sc
import torch
import torch.distributed as dist


def load(exists):
    if exists:
        state = [{"step": 7} if sc.RANK == 0 else None]
        dist.broadcast_object_list(state, src=0)


def sync_grads():
    dist.all_reduce(torch.ones(16))


sc.self_destruct()
sc.init_gloo()
if sc.RANK != 2:
    sc.ready_when_in("broadcast_object_list")
load(exists=sc.RANK != 2)
sc.ready_when_in("all_reduce")
sync_grads()
