"""Pipeline stages that each receive before they send: every stage waits for its neighbour's
activation, and none sends. Every rank waits in a point-to-point receive.

Source: https://github.com/pytorch/pytorch/issues/172668 ("both ranks are waiting for the send
to finish so that they can receive. But neither of ranks are receiving")
"""
# expect: {"nproc": 2, "kind": "p2p_cycle", "odd_ranks": []}

import _scenario as sc
import torch
import torch.distributed as dist


def recv_activation(buf):
    dist.recv(buf, src=1 - sc.RANK)


def send_activation(t):
    dist.send(t, dst=1 - sc.RANK)


sc.self_destruct()
sc.init_gloo()
buf = torch.zeros(8)
sc.ready_when_in("recv")
recv_activation(buf)
send_activation(buf + 1)
