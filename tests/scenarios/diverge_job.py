"""diverge: ranks that should agree, on areal's worker runtime. MODE picks what disagrees:

    replicated   a plain model on 2 ranks; rank 1's weight[2, 3] is off by 0.5, and so its
                 gradients and loss after the same batch
    tp           dp=2 x tp=2 (AREAL_MESH); a norm weight replicated on both dims drifts by
                 1e-3 on rank 3; a tp-sharded weight differs by design
    fsdp         FSDP2 on 2 ranks with a buffer and a reduced loss: all agree

Each rank calls check_consistency once and writes SCENARIO_DIR/report-<rank>.json, then steps
forever (an all_reduce and ctx.progress(step) every STEP_S seconds) for `areal doctor diverge`.

ARM_DELAY_RANK / ARM_DELAY_S: that rank answers the doctor's arm request only after a delay,
as a rank behind a slow round trip (another node, a loaded host) does.
"""

import json
import os
import time
from pathlib import Path

import _scenario as sc
import torch
import torch.distributed as dist
from torch import nn

from areal_cli.worker import check_consistency, connect, watch

MODE = os.environ["MODE"]
sc.self_destruct()
ctx = connect()
torch.manual_seed(0)
loss = None
optimizer = None

if MODE == "replicated":
    model = nn.Linear(8, 8)
    if sc.RANK == 1:
        with torch.no_grad():
            model.weight[2, 3] += 0.5
    # The same batch on both ranks: the changed weight changes its gradients and the loss.
    loss = model(torch.ones(4, 8)).square().sum()
    loss.backward()
elif MODE == "tp":
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            rep = [Replicate(), Replicate()]
            self.norm = nn.Parameter(distribute_tensor(torch.ones(8), ctx.mesh, rep))
            full = torch.arange(64, dtype=torch.float32).reshape(8, 8)
            self.proj = nn.Parameter(distribute_tensor(full, ctx.mesh, [Replicate(), Shard(0)]))

    model = Block()
    if sc.RANK == 3:
        with torch.no_grad():
            model.norm.to_local().add_(1e-3)
else:
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model.register_buffer("scale", torch.full((4,), 2.0))
    fully_shard(model, mesh=ctx.mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8) + sc.RANK
    out = model(x).sum()
    out.backward()
    optimizer.step()
    loss = out.detach().clone()
    dist.all_reduce(loss)  # what a script logs: the same on every rank

report = check_consistency(model, optimizer, loss)
Path(os.environ["SCENARIO_DIR"], f"report-{sc.RANK}.json").write_text(json.dumps(report.to_json()))
if not os.environ.get("NO_WATCH"):  # NO_WATCH=1: a job that names no model to the doctor
    watch(model, optimizer)
if os.environ.get("ARM_DELAY_RANK") == str(sc.RANK):
    from areal_cli.worker import channel

    arm = channel.HANDLERS["diverge_arm"]

    def slow_arm(req, arm=arm):
        time.sleep(float(os.environ["ARM_DELAY_S"]))
        return arm(req)

    channel.register("diverge_arm", slow_arm)
step = 0
while True:
    dist.all_reduce(torch.ones(1))
    ctx.progress(step)
    step += 1
    time.sleep(float(os.environ.get("STEP_S", "0.05")))
