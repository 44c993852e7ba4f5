"""Training steps while a checkpoint is saved in the background, against the same steps
without a save, in one run.

    python benchmarks/bench_checkpoint.py [--hidden 256 --layers 4] [--window 4] [--windows 5]

Two FSDP2 ranks (torchrun, gloo) train a Qwen2-style model (areal's modelgen, the model
`areal init-model` writes, scaled up: about 3M parameters, a checkpoint of 38 MB with AdamW's
state; `--hidden 512 --layers 8`: 22M and 288 MB, steps of seconds on two busy cores) on
random batches of 4 x 64 tokens. Windows of `--window` steps alternate, in an order that
flips each round: without a save; with `Checkpointer.save(background=True)` called after the
window's first step; with a save in the foreground (the contrast). A window's time runs until
its save is whole (`wait()` at its end), so what the background writes cost the steps that
overlap them is counted, not only the copy to CPU memory.

Prints `checkpoint_background_window_ratio` (median window with a background save / median
window without; target <= 1.05), the step that calls the save (its training plus the copy)
against a step without, and the foreground save's ratio for contrast.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import loadavg, report  # noqa: E402

TARGET = 1.05

TRAINER = r"""
import json, sys, time, torch, torch.distributed as dist
from transformers import AutoModelForCausalLM
from areal_cli.worker import close, connect, shard_model
from areal_cli.worker.checkpoint import Checkpointer
model_dir, root, window, windows, out = sys.argv[1:6]
window, windows = int(window), int(windows)
ctx = connect()
torch.manual_seed(ctx.rank)
model = shard_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), ctx.mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
ckpt = Checkpointer(root, keep=1)
saves = 0

def step():
    batch = torch.randint(0, 256, (4, 64))
    opt.zero_grad()
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()

def run(mode):
    global saves
    dist.barrier()
    t0 = time.perf_counter()
    steps = []
    for i in range(window):
        s = time.perf_counter()
        step()
        if i == 0 and mode != "plain":
            saves += 1
            ckpt.save(saves, model, opt, background=mode == "background")
        steps.append(time.perf_counter() - s)
    ckpt.wait()
    dist.barrier()
    return time.perf_counter() - t0, steps

for mode in ("plain", "background", "foreground"):  # warm-up: first plans, page cache
    run(mode)
got = {"plain": [], "background": [], "foreground": [], "save_step": [], "plain_step": []}
modes = ["plain", "background", "foreground"]
for w in range(windows):
    for mode in (modes if w % 2 == 0 else modes[::-1]):
        t, steps = run(mode)
        got[mode].append(t)
        if mode == "background":
            got["save_step"].append(steps[0])
        elif mode == "plain":
            got["plain_step"].extend(steps)
ckpt.close()
if ctx.rank == 0:
    open(out, "w").write(json.dumps(got))
del model, opt
close()
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--windows", type=int, default=5)
    args = ap.parse_args()
    from areal_cli.modelgen import create_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        root = Path(tmp)
        model = create_tiny_model(root / "model", hidden_size=args.hidden, num_layers=args.layers,
                                  intermediate_size=args.hidden * 11 // 4, seed=0)  # fmt: skip
        script = root / "trainer.py"
        script.write_text(TRAINER)
        out = root / "result.json"
        env = {**os.environ, "AREAL_LOG_DIR": str(root / "logs"), "OMP_NUM_THREADS": "1",
               "HF_HUB_OFFLINE": "1"}  # fmt: skip
        res = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             "2", str(script), str(model), str(root / "ckpt"), str(args.window),
             str(args.windows), str(out)],
            env=env, capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
        if res.returncode != 0:
            sys.exit(f"trainer failed ({res.returncode}):\n{res.stderr[-3000:]}")
        got = json.loads(out.read_text())
        size = sum(f.stat().st_size for f in (root / "ckpt").rglob("*") if f.is_file())
    med = {k: statistics.median(v) for k, v in got.items()}
    print(f"  {args.window}-step windows, {args.windows} of each (medians; checkpoint "
          f"{size / 1e6:.0f} MB; load average {loadavg()}): without a save "
          f"{med['plain']:.2f} s, background save {med['background']:.2f} s, foreground save "
          f"{med['foreground']:.2f} s; the step that calls the background save "
          f"{med['save_step']:.3f} s against {med['plain_step']:.3f} s")  # fmt: skip
    print(
        f"  checkpoint_save_step_ratio: {med['save_step'] / med['plain_step']:.3f} "
        "(the step that calls save: training + copy to CPU)"
    )
    print(
        f"  checkpoint_foreground_window_ratio: {med['foreground'] / med['plain']:.3f} "
        "(contrast: the same save in the foreground)"
    )
    ratio = med["background"] / med["plain"]
    ok = report("checkpoint_background_window_ratio", ratio, f"<= {TARGET}", ratio <= TARGET)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
