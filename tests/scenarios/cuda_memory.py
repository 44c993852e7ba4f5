"""cuda_memory: one rank on areal's worker runtime holds 256 MiB of CUDA memory and steps."""

import time

import _scenario as sc
import torch

from areal_cli.worker import connect

sc.self_destruct()
ctx = connect()
held = torch.empty(64 << 20, dtype=torch.float32, device=ctx.device)  # 256 MiB
step = 0
while True:
    held.add_(1.0)
    ctx.progress(step)
    step += 1
    time.sleep(0.05)
