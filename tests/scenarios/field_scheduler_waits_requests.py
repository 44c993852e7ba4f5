"""A tensor-parallel server whose ranks decided differently: the others entered the logits
all-gather of a batch, the first waits for requests to be broadcast to it (its request queue
stays empty).

Source: https://github.com/sgl-project/sglang/issues/33289 ("one rank wedges in NCCL proxy
append (logits all-gather), peer idles at request broadcast")
"""
# expect: {"nproc": 3, "kind": "mismatched_collective", "odd_ranks": [0]}

import queue

import _scenario as sc
import torch
import torch.distributed as dist

requests: queue.Queue = queue.Queue()


def recv_requests():
    return requests.get()


def gather_logits():
    out = torch.zeros(sc.WORLD_SIZE * 4)
    dist.all_gather_into_tensor(out, torch.ones(4))


sc.self_destruct()
sc.init_gloo()
if sc.RANK == 0:
    sc.ready_when_in("recv_requests")
    recv_requests()
sc.ready_when_in("all_gather_into_tensor")
gather_logits()
