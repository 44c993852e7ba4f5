"""A toy job's trainer: find the servers through the job's registry, then hang as
templates/examples/hang.py does (the last rank never joins the all_reduce)."""

import threading

import torch
import torch.distributed as dist

from areal_cli.worker import connect

ctx = connect()
client = ctx.rollout_client()
print(f"rank {ctx.rank}: {client.run(client.model_info())!r}", flush=True)
print(f"rank {ctx.rank}: ready", flush=True)
if ctx.rank == ctx.world_size - 1:
    threading.Event().wait()
else:
    dist.all_reduce(torch.ones(8))
