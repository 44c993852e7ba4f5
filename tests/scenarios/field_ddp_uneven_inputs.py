"""Uneven inputs under DDP: the last rank's shard holds one batch fewer. It leaves the loop and
waits for its checkpoint writer, while the others sit in `loss.backward()` where DDP's reducer
all-reduces the gradients from C++ (their Python stacks show no collective).

Source: https://github.com/microsoft/PyMarlin/issues/80 ("If you run training with an uneven
number of batches on different GPUs, a hang will occur")
"""
# expect: {"nproc": 3, "kind": "mismatched_collective", "odd_ranks": [2]}

import threading

import _scenario as sc
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

written = threading.Event()


def save_checkpoint():
    writer = threading.Thread(target=written.wait, name="ckpt-writer")
    writer.start()
    writer.join()  # the writer waits for the last step's state, which never comes


def train(model, batches):
    for i, batch in enumerate(batches):
        if i == len(batches) - 1:
            sc.ready_when_in("_engine_run_backward")
        model(batch).sum().backward()


sc.self_destruct()
sc.init_gloo()
torch.manual_seed(0)
train(DDP(nn.Linear(8, 8)), [torch.ones(2, 8)] * (2 if sc.RANK == 2 else 3))
sc.ready_when_in("save_checkpoint")
save_checkpoint()
