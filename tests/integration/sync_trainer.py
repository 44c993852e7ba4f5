"""A trainer that only syncs weights, for the weight-sync tests and benchmark.

    python sync_trainer.py --model DIR --servers A,B [--syncs N] [--method distributed|disk]
    torchrun --nproc-per-node 2 sync_trainer.py ...     (FSDP2 over two ranks, gloo)

Before sync k (k = 1..N) it adds k * 0.01 to every floating weight, so every sync sends
other weights. After each sync rank 0 prints one JSON line: {"sync", "ok", "version",
"seconds", "servers", "failed", "versions" | "error", "expected"}, where "expected" is the
greedy continuation
of PROMPT by its own model, which a server holding these weights must reproduce.
With --wait-file F it waits for F to exist before each sync after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

PROMPT = [72, 101, 108, 108, 111]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--servers", required=True)
    ap.add_argument("--syncs", type=int, default=1)
    ap.add_argument("--method", default="distributed")
    ap.add_argument("--backend", default="hf", help="the engine the servers run")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--bucket-bytes", type=int, default=256 << 20)
    ap.add_argument("--wait-file", default=None)
    ap.add_argument("--weights-dir", default=None)
    ap.add_argument("--flatten", nargs="?", const="all", default="auto",
                    choices=["auto", "all", "none"],
                    help="flattened_bucket buckets: all, none (tensor by tensor), or auto "
                    "(sync_weights' default)")  # fmt: skip
    ap.add_argument("--stall-timeout", type=float, default=10.0)
    ap.add_argument("--probe-timeout", type=float, default=5.0)
    ap.add_argument("--no-instance-id", action="store_true",
                    help="read /server_info as SGLang answers it: without an instance id")  # fmt: skip
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from areal_cli.worker import connect, shard_model, sync_weights
    from areal_cli.worker.rollout import RolloutClient

    os.environ.setdefault("AREAL_LLM_SERVER_ADDRS", args.servers)
    os.environ.setdefault("AREAL_SERVER_BACKEND", args.backend)
    ctx = connect()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    if ctx.world_size > 1:
        model = shard_model(model, ctx.mesh)
    client = RolloutClient(
        args.servers.split(","),
        backend=args.backend,
        api_key=os.environ.get("AREAL_API_KEY") or None,
        retries=0,
        cooldown=1.0,
        stall_timeout=args.stall_timeout,
        probe_timeout=args.probe_timeout,
    )
    if args.no_instance_id:
        server_info = client.server_info

        async def without_instance_id(addr: str) -> dict:
            info = await server_info(addr)
            info.pop("instance_id", None)
            return info

        client.server_info = without_instance_id
    for k in range(1, args.syncs + 1):
        if k > 1 and args.wait_file:
            while not Path(args.wait_file).exists():
                time.sleep(0.05)
        with torch.no_grad():
            for p in list(model.parameters()) + list(reference.parameters()):
                if p.is_floating_point():
                    p.add_(0.01 * k)
        started = time.perf_counter()
        line: dict = {"sync": k}
        try:
            out = sync_weights(
                model,
                client,
                Path(args.weights_dir) / f"v{k}" if args.method == "disk" else None,
                method=args.method,
                version=k,
                timeout=args.timeout,
                bucket_bytes=args.bucket_bytes,
                tokenizer_from=args.model if args.method == "disk" else None,
                flatten={"auto": None, "all": True, "none": False}[args.flatten],
            )
            line.update(ok=True, version=out["version"], bytes=out["bytes"])
            line.update(servers=out["servers"], failed=out["failed"], versions=out["versions"])
        except Exception as e:  # the test reads what the user would read
            line.update(ok=False, error=str(e), detail=getattr(e, "detail", None))
        line["seconds"] = time.perf_counter() - started
        with torch.no_grad():
            ids = torch.tensor([PROMPT])
            out_ids = reference.generate(ids, max_new_tokens=6, do_sample=False)
            line["expected"] = out_ids[0, len(PROMPT) :].tolist()
        if ctx.is_main:
            print(json.dumps(line), flush=True)
    client.close_sync()
    ctx.close()


if __name__ == "__main__":
    sys.exit(main())
