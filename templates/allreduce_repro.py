"""Minimal all_reduce repro and bandwidth test, in the style of nccl-tests' all_reduce_perf.

Standalone: needs only PyTorch. Attach it to a bug report as it is.

    torchrun --nproc-per-node 8 allreduce_repro.py                    # nccl, 1K..256M
    torchrun --nproc-per-node 2 allreduce_repro.py --backend gloo --sizes 1K:16M

For every size (doubling from min to max) it runs `warmup` untimed and `iters` timed in-place
all_reduce(SUM) calls on a float tensor, then one checked call on a known pattern, and prints

    size (bytes), count (elements), time (us, slowest rank), algbw = size / time,
    busbw = algbw * 2(n-1)/n (what a ring all_reduce moves per rank), #wrong elements

Environment:
    AREAL_ALLREDUCE_RESULTS   rank 0 appends one JSON line per size to this file
    AREAL_ALLREDUCE_FORCE_HANG=1
                              the last rank skips the first timed all_reduce and waits forever:
                              a deliberate hang, for testing hang diagnosis
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B") or "0"
    unit = text[-1] if text[-1] in UNITS else ""
    number = text[:-1] if unit else text
    return int(float(number) * UNITS[unit])


def sizes_between(spec: str) -> list[int]:
    lo, _, hi = spec.partition(":")
    lo_b = parse_size(lo)
    hi_b = parse_size(hi or lo)
    out, size = [], max(lo_b, 1)
    while size <= hi_b:
        out.append(size)
        size *= 2
    return out


def skip_collective() -> None:
    """The forced hang: this rank never joins the all_reduce the others are in."""
    threading.Event().wait()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--backend", default="nccl" if torch.cuda.is_available() else "gloo")
    ap.add_argument("--sizes", default="1K:256M", help="MIN:MAX in bytes, K/M/G suffixes")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--pg-timeout", type=float, default=600.0, help="collective timeout, seconds")
    args = ap.parse_args()

    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dtype = DTYPES[args.dtype]
    elem = torch.tensor([], dtype=dtype).element_size()
    results_path = os.environ.get("AREAL_ALLREDUCE_RESULTS")
    force_hang = os.environ.get("AREAL_ALLREDUCE_FORCE_HANG") == "1"

    if rank == 0:
        print(
            f"# all_reduce repro: torch {torch.__version__}, backend {args.backend}, "
            f"world size {world}, dtype {args.dtype}, iters {args.iters}, warmup {args.warmup}"
        )
        if args.backend == "nccl":
            print(
                f"# nccl {'.'.join(map(str, torch.cuda.nccl.version()))}, "
                f"{torch.cuda.get_device_name(device)}"
            )
        print(f"#  Rank 0 pid {os.getpid()} on {socket.gethostname()} device {device}")
        print("#")
        print(
            f"# {'size':>12} {'count':>12} {'type':>9} {'redop':>6} {'time':>10} "
            f"{'algbw':>8} {'busbw':>8} {'#wrong':>7}"
        )
        print(
            f"# {'(B)':>12} {'(elements)':>12} {'':>9} {'':>6} {'(us)':>10} "
            f"{'(GB/s)':>8} {'(GB/s)':>8} {'':>7}",
            flush=True,
        )

    busbws = []
    for i, size in enumerate(sizes_between(args.sizes)):
        count = max(1, size // elem)
        nbytes = count * elem
        buf = torch.zeros(count, dtype=dtype, device=device)
        if force_hang and i == 0 and rank == world - 1:
            skip_collective()
        for _ in range(args.warmup):
            dist.all_reduce(buf)
        sync(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(buf)
        sync(device)
        elapsed = (time.perf_counter() - start) / max(args.iters, 1)
        # The slowest rank sets the pace of a collective.
        t = torch.tensor([elapsed], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        elapsed = t.item()

        # Correctness: rank r holds r+1+(i%7); the sum is n(n+1)/2 + n*(i%7), exact in floats.
        pattern = torch.arange(count, device=device) % 7
        check = (pattern + (rank + 1)).to(dtype)
        dist.all_reduce(check)
        expected = (pattern * world + world * (world + 1) // 2).to(dtype)
        wrong = torch.tensor([int((check != expected).sum().item())], device=device)
        dist.all_reduce(wrong)

        algbw = nbytes / elapsed / 1e9
        busbw = algbw * 2 * (world - 1) / world
        busbws.append(busbw)
        if rank == 0:
            row = {
                "size": nbytes,
                "count": count,
                "type": args.dtype,
                "redop": "sum",
                "time_us": elapsed * 1e6,
                "algbw_gbps": algbw,
                "busbw_gbps": busbw,
                "wrong": int(wrong.item()),
                "world_size": world,
                "backend": args.backend,
            }
            print(
                f"  {nbytes:>12} {count:>12} {args.dtype:>9} {'sum':>6} {elapsed * 1e6:>10.1f} "
                f"{algbw:>8.3f} {busbw:>8.3f} {row['wrong']:>7}",
                flush=True,
            )
            if results_path:
                with open(results_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
    if rank == 0 and busbws:
        print(f"# Avg bus bandwidth    : {sum(busbws) / len(busbws):.3f} GB/s", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
