"""check_consistency's cost against the training step it checks: 2 gloo ranks, a ~100M
parameter model (12 Linear layers of 2880, replicated, gradients all_reduced as DDP does, AdamW),
one step on TOKENS tokens per rank. In the same run, on the same ranks:

    step    forward, backward, all_reduce of the gradients, optimizer step
    check   check_consistency(model, optimizer, loss): parameters, gradients, Adam's two
            moments and steps (about 4 x 100M values), checksums all_gathered

    consistency_vs_step: 0.05   (check / step; target <= 0.10)

The ratio falls as the step grows: tokens per step scale the step, not the check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import report  # noqa: E402

TOKENS = int(os.environ.get("BENCH_TOKENS", "2048"))
WORKER = r"""
import json, os, sys, time
import torch, torch.distributed as dist
from torch import nn
from areal_cli.worker import check_consistency
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(2880, 2880) for _ in range(12)])
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(int(sys.argv[2]), 2880)
def step():
    opt.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    opt.step()
    dist.all_reduce(loss.detach())
    return loss.detach()
loss = step()  # warm-up: Adam's state exists from here
check_consistency(model, opt, loss)
dist.barrier(); t0 = time.perf_counter(); loss = step(); dist.barrier()
step_s = time.perf_counter() - t0
times = []
for _ in range(2):
    dist.barrier(); t0 = time.perf_counter(); rep = check_consistency(model, opt, loss)
    dist.barrier(); times.append(time.perf_counter() - t0)
n = sum(p.numel() for p in model.parameters())
if dist.get_rank() == 0:
    open(sys.argv[1], "w").write(json.dumps({"params": n, "step_s": step_s,
        "check_s": min(times), "ok": rep.ok, "checked": rep.checked}))
dist.destroy_process_group()
"""


def main() -> int:
    with tempfile.TemporaryDirectory() as d:
        script, out = Path(d) / "worker.py", Path(d) / "out.json"
        script.write_text(WORKER)
        port = 29000 + os.getpid() % 1000
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-addr", "127.0.0.1", "--master-port", str(port), str(script), str(out),
             str(TOKENS)],
            check=True, env=env, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        got = json.loads(out.read_text())
    ratio = got["check_s"] / got["step_s"]
    print(f"  {got['params'] / 1e6:.1f}M parameters, {TOKENS} tokens per rank: step "
          f"{got['step_s']:.2f}s, check {got['check_s']:.3f}s ({got['checked']} comparisons, "
          f"all agree: {got['ok']})")  # fmt: skip
    ok = got["ok"] and ratio <= 0.10
    return 0 if report("consistency_vs_step", ratio, "<= 0.10", ok) else 1


if __name__ == "__main__":
    sys.exit(main())
