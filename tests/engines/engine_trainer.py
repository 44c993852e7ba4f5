"""A trainer that only syncs weights to one real engine, as a training script would.

    ENGINE_KEY=... python engine_trainer.py --model DIR --server ADDR --backend sglang \\
        --method distributed|disk [--weights-dir D] [--version V] [--shift X] [--syncs N]

It adds X to every floating weight (so the server gets other weights), syncs them with
areal_cli.worker.sync_weights (N times, X added before each, one client: the last sync is
version V, the ones before V-1, V-2 ...), and prints one JSON line: {"ok", "version",
"versions", "error", "expected"}, "expected" being the greedy continuation of PROMPT by its
own model after the last sync.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

PROMPT = [72, 101, 108, 108, 111]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--server", required=True)
    ap.add_argument("--backend", required=True)
    ap.add_argument("--method", required=True)
    ap.add_argument("--weights-dir", default=None)
    ap.add_argument("--version", default="1")
    ap.add_argument("--shift", type=float, default=0.01)
    ap.add_argument("--syncs", type=int, default=1)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from areal_cli.worker import sync_weights
    from areal_cli.worker.rollout import RolloutClient

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    client = RolloutClient([args.server], backend=args.backend,
                           api_key=os.environ.get("ENGINE_KEY") or None, retries=0)  # fmt: skip
    line: dict = {}
    for k in range(args.syncs - 1, -1, -1):
        version = args.version if k == 0 else f"{args.version}-{k}"
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point():
                    p.add_(args.shift)
        try:
            out = sync_weights(
                model, client,
                Path(args.weights_dir) / f"v{version}" if args.method == "disk" else None,
                method=args.method, version=version, timeout=120,
                tokenizer_from=args.model if args.method == "disk" else None,
            )  # fmt: skip
            line.update(ok=True, version=out["version"], versions=out["versions"])
            line.update(failed=out["failed"])
        except Exception as e:  # the test reads what the user would read
            line.update(ok=False, error=str(e), detail=str(getattr(e, "detail", "")))
            break
    with torch.no_grad():
        ids = model.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False)
    line["expected"] = ids[0, len(PROMPT) :].tolist()
    client.close_sync()
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    sys.exit(main())
