"""A training script for the checkpoint tests, run under torchrun (gloo, CPU ranks).

    checkpoint_worker.py MODEL OUT roundtrip   save in the background while training goes on,
                                               load into a fresh model, keep the last two
    checkpoint_worker.py MODEL OUT interrupt   save step 1, then a save of step 2 whose write
                                               stops on rank 1 (OUT/writing names its pid)
    checkpoint_worker.py MODEL OUT resume      load what `interrupt` left

Each rank writes OUT/<mode>-rank<R>.json with what it found.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from transformers import AutoModelForCausalLM

from areal_cli.worker import close, connect, shard_model
from areal_cli.worker.checkpoint import Checkpointer, checkpoints, latest


def build(model_dir: str, ctx):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = shard_model(model, ctx.mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, optimizer, seed: int) -> None:
    batch = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(seed))
    optimizer.zero_grad()
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()


def snapshot(model, optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer tensor, whole (gathered from the shards), copied."""
    out = {}
    for name, p in model.named_parameters():
        out[f"param/{name}"] = p.full_tensor().detach().clone()
        for key, v in optimizer.state[p].items():
            full = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[f"optim/{name}/{key}"] = full.detach().clone()
    return out


def draws() -> list[float]:
    return [torch.rand(1).item(), random.random(), float(np.random.rand())]


def differences(a: dict, b: dict) -> list[str]:
    if a.keys() != b.keys():
        return [f"keys differ: {sorted(set(a) ^ set(b))[:5]}"]
    return [k for k in a if not torch.equal(a[k], b[k])]


class StopsWriting(DefaultSavePlanner):
    """Stops the write of this rank half way: the test kills the rank meanwhile."""

    def __init__(self, out: Path, rank: int):
        super().__init__()
        self.out, self.rank, self.calls, self.armed = out, rank, 0, False

    def resolve_data(self, write_item):
        self.calls += self.armed
        if self.rank == 1 and self.calls == 3:
            (self.out / "writing").write_text(str(os.getpid()))
            threading.Event().wait()
        return super().resolve_data(write_item)


def main(model_dir: str, out: Path, mode: str) -> None:
    ctx = connect()
    rank = ctx.rank
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    np.random.seed(300 + rank)
    model, optimizer = build(model_dir, ctx)
    result: dict = {"rank": rank}
    if mode == "roundtrip":
        ckpt = Checkpointer(keep=2)
        for step in range(2):
            train(model, optimizer, seed=step * 10 + rank)
        saved = snapshot(model, optimizer)
        ckpt.save(2, model, optimizer, extra={"data": 16})  # background
        expected_draws = draws()
        # The optimizer moves the weights while the save is still being written.
        train(model, optimizer, seed=99 + rank)
        moved = snapshot(model, optimizer)
        ckpt.wait()
        result["latest_after_wait"] = latest(ckpt.root).step
        fresh, fresh_opt = build(model_dir, ctx)
        got = ckpt.load(fresh, fresh_opt)
        result["loaded_step"] = got.step
        result["loaded_extra"] = got.extra
        result["draws_equal"] = draws() == expected_draws
        result["differences"] = differences(saved, snapshot(fresh, fresh_opt))
        result["moved"] = len(differences(saved, moved))
        # Training goes on from the restored state exactly as from the saved one.
        for step in (3, 4, 5):
            train(fresh, fresh_opt, seed=step)
            ckpt.save(step, fresh, fresh_opt, background=step != 4)
        ckpt.wait()
        result["kept"] = [c.step for c in checkpoints(ckpt.root)]
        result["entries"] = sorted(p.name for p in ckpt.root.iterdir())
        modes = {}
        for dirpath, dirnames, names in os.walk(ckpt.root):
            for n in dirnames + names:
                p = os.path.join(dirpath, n)
                modes[os.path.relpath(p, ckpt.root)] = oct(os.stat(p).st_mode & 0o777)
        modes["."] = oct(os.stat(ckpt.root).st_mode & 0o777)
        result["modes"] = modes
        ckpt.close()
    elif mode == "interrupt":
        planner = StopsWriting(out, rank)
        ckpt = Checkpointer(keep=3, planner=planner)
        train(model, optimizer, seed=rank)
        ckpt.save(1, model, optimizer, background=False)
        torch.save(snapshot(model, optimizer), out / f"step1-rank{rank}.pt")
        train(model, optimizer, seed=7 + rank)
        planner.armed = True
        ckpt.save(2, model, optimizer)
        ckpt.wait()  # rank 1 never finishes writing: the test kills it
    elif mode == "resume":
        ckpt = Checkpointer(keep=3)
        result["entries_after_start"] = sorted(p.name for p in ckpt.root.iterdir())
        got = ckpt.load(model, optimizer)
        result["loaded_step"] = got.step
        saved = torch.load(out / f"step1-rank{rank}.pt")
        result["differences"] = differences(saved, snapshot(model, optimizer))
        ckpt.close()
    (out / f"{mode}-rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
    close()
