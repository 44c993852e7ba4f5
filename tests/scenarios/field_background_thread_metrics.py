"""Collectives from a background thread: each rank's metrics thread all-reduces a statistic
when its main thread hands it one; the main threads wait for the result. The last rank's main
thread handed nothing (its own count of logging steps differs), so its metrics thread still
waits for work while the others' sit in the all_reduce.

Source: https://github.com/Lightning-AI/pytorch-lightning/issues/19106 (metrics logged with
different keys on different ranks: the ranks all-reduce different metrics and deadlock)
"""
# expect: {"nproc": 3, "kind": "mismatched_collective", "odd_ranks": [2]}

import queue
import threading

import _scenario as sc
import torch
import torch.distributed as dist

work: queue.Queue = queue.Queue()
done = threading.Event()


def metrics_worker():
    stat = work.get()
    if stat is not None:
        sc.touch(f"ready-{sc.RANK}")
    dist.all_reduce(stat)
    done.set()


def wait_for_metrics():
    done.wait()


sc.self_destruct()
sc.init_gloo()
threading.Thread(target=metrics_worker, name="metrics", daemon=True).start()
if sc.RANK != 2:
    work.put(torch.ones(4))
else:
    sc.ready_when_in("wait_for_metrics")
wait_for_metrics()
