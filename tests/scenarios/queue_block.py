"""blocked_outside_collective: every rank waits on a queue nobody fills."""

import queue

import _scenario as sc

batches: queue.Queue = queue.Queue()


def next_batch():
    return batches.get()


sc.self_destruct()
sc.init_gloo()
sc.ready_when_in("next_batch")
next_batch()
