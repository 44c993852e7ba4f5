"""Evaluation entered by the main process only (its progress bar decided who evaluates): it
gathers the metrics (`all_gather_object`) while the others went on to the next training step and
all-reduce their loss.

Source: https://github.com/huggingface/transformers/issues/31532 ("only the main process enter
into the evaluate part, so the gather_for_metrics is waiting for the other process forever")
"""
# expect: {"nproc": 3, "kind": "collective_type_mismatch", "odd_ranks": [0]}

import _scenario as sc
import torch
import torch.distributed as dist


def evaluate():
    metrics = [None] * sc.WORLD_SIZE
    dist.all_gather_object(metrics, {"acc": 0.5})


def train_step():
    dist.all_reduce(torch.tensor([1.0]))


sc.self_destruct()
sc.init_gloo()
if sc.RANK == 0:
    sc.ready_when_in("all_gather_object")
    evaluate()
sc.ready_when_in("all_reduce")
train_step()
