"""Weight sync to inference servers: a broadcast over a process group against a checkpoint on
disk, in one run.

    python benchmarks/bench_weight_sync.py [--hidden 768 --layers 16] [--rounds 5] [--grpo-steps 10]

1. A ~100M-parameter Qwen2-style model is written locally (areal's modelgen, the model
   `areal init-model` writes, scaled up) and served by two hf replicas. One trainer process
   syncs it to both, alternating `sync_weights(method="distributed")` (gloo broadcast of
   flattened buckets) and `method="disk"` (an HF checkpoint both replicas reload); the first
   distributed sync, which builds the group, is a warm-up. Prints the median seconds and
   MB/s of each, and `weight_sync_distributed_over_disk` (target <= 0.5).
2. The GRPO example (tiny model, two FSDP ranks, one hf server) runs a few steps with each
   method; prints the share of the step time spent syncing weights (medians over steps).
3. With the SGLang CPU build (`make engines`): the same alternation against one real SGLang
   replica under `areal serve` (its distributed update over gloo: the small tensors as one
   flattened bucket, the large ones tensor by tensor; its disk update reloading the
   checkpoint), for the tiny model and for the ~100M one; prints
   `weight_sync_distributed_over_disk[sglang,tiny|100M]` (target <= 0.5 each). Without the
   build, skip lines. `--only-sglang` runs this part alone.

Each method's line is followed by its split: the median milliseconds of each route (first
request sent to last answer), of rank 0's broadcasts (inside the update's span), of writing
the checkpoint, and the rest (the trainer's own work between requests).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import report  # noqa: E402

TARGET = 0.5
REPO = Path(__file__).resolve().parents[1]

TRAINER = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM
from areal_cli.backends import sync_sglang
from areal_cli.worker.rollout import RolloutClient
from areal_cli.worker.weights import sync_weights
model_dir, servers, rounds, out_dir = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), sys.argv[4]
backend = sys.argv[5] if len(sys.argv) > 5 else "hf"
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
client = RolloutClient(servers, backend=backend)
# Where a sync's time goes: each route's span (first request sent to last answer, over all
# servers) and rank 0's broadcasts (inside the update's span).
spans = []
request = client._request
async def timed(server, method, path, *args, **kw):
    t = time.perf_counter()
    try:
        return await request(server, method, path, *args, **kw)
    finally:
        spans.append((path.strip("/"), t, time.perf_counter()))
client._request = timed
broadcast = sync_sglang.broadcast_bucket
def timed_broadcast(*args):
    t = time.perf_counter()
    try:
        return broadcast(*args)
    finally:
        spans.append(("(broadcast)", t, time.perf_counter()))
sync_sglang.broadcast_bucket = timed_broadcast
def once(method, k):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3)
    spans.clear()
    t = time.perf_counter()
    out = sync_weights(model, client, f"{out_dir}/v{k}" if method == "disk" else None,
                       method=method, version=k, tokenizer_from=model_dir)
    seconds = time.perf_counter() - t
    split = {}
    for name, a, b in spans:
        lo, hi = split.get(name, (a, b))
        split[name] = (min(lo, a), max(hi, b))
    split = {n: hi - lo for n, (lo, hi) in split.items()}
    if "save_s" in out:
        split["(save checkpoint)"] = out["save_s"]
    split["(rest)"] = seconds - sum(v for n, v in split.items() if n != "(broadcast)")
    return {"method": method, "seconds": seconds, "bytes": out["bytes"], "split": split}
print(json.dumps({"warmup": once("distributed", 0)}), flush=True)
k = 1
for _ in range(rounds):
    for method in ("distributed", "disk"):
        print(json.dumps(once(method, k)), flush=True)
        k += 1
client.close_sync()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_cli.server", "--model-path", str(model), "--port", str(port)],
        stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    return proc, f"127.0.0.1:{port}"


def _wait_healthy(addr: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server {addr} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://{addr}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"server {addr} not healthy after {timeout}s")


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _m100(root: Path, hidden: int, layers: int) -> Path:
    from areal_cli.modelgen import create_tiny_model

    return create_tiny_model(root / "m100", hidden_size=hidden, num_layers=layers,
                             num_heads=12, num_kv_heads=4, intermediate_size=2048)  # fmt: skip


def _alternate(root: Path, model: Path, addrs: str, rounds: int, backend: str, what: str):
    """Run the trainer; print and return the median seconds of each method."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, "-c", TRAINER, str(model), addrs, str(rounds), str(root / "ckpt"),
         backend], capture_output=True, text=True, env=env, timeout=3600,
    )  # fmt: skip
    if res.returncode != 0:
        raise SystemExit(f"trainer failed:\n{res.stderr[-3000:]}")
    lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    warmup = lines[0]["warmup"]
    by = {m: [x for x in lines[1:] if x["method"] == m] for m in ("distributed", "disk")}
    med = {m: statistics.median(x["seconds"] for x in rows) for m, rows in by.items()}
    mb = {m: by[m][0]["bytes"] / 1e6 for m in by}
    print(f"distributed first sync (builds the group): {warmup['seconds']:.2f}s", flush=True)
    for m in ("distributed", "disk"):
        least = min(x["seconds"] for x in by[m])
        print(f"{m}: median {med[m]:.3f}s (min {least:.3f}s) of {len(by[m])}, {mb[m]:.1f} MB "
              f"per sync, {mb[m] / med[m]:.0f} MB/s ({what})", flush=True)  # fmt: skip
        names = list(dict.fromkeys(n for x in by[m] for n in x["split"]))
        parts = ", ".join(f"{n} {statistics.median(x['split'].get(n, 0) for x in by[m]) * 1000:.1f}"
                          for n in names)  # fmt: skip
        print(f"  {m} split, median ms: {parts}", flush=True)
    return med


def sync_benchmark(root: Path, hidden: int, layers: int, rounds: int) -> bool:
    from areal_cli.modelgen import model_summary

    model = _m100(root, hidden, layers)
    params = model_summary(model)["params"]
    print(f"model: {params / 1e6:.1f}M parameters (float32), 2 hf replicas", flush=True)
    servers = [_serve(model, root / f"server-{i}.log") for i in range(2)]
    try:
        for proc, addr in servers:
            _wait_healthy(addr, proc)
        addrs = ",".join(addr for _, addr in servers)
        med = _alternate(root, model, addrs, rounds, "hf", "to each of 2 replicas")
    finally:
        _stop([p for p, _ in servers])
    ratio = med["distributed"] / med["disk"]
    return report("weight_sync_distributed_over_disk", ratio, f"<= {TARGET}", ratio <= TARGET)


def sglang_benchmark(root: Path, hidden: int, layers: int, rounds: int) -> bool:
    """Distributed ÷ disk against one real SGLang replica: the tiny model, then ~100M."""
    from _engines import sglang_python, sglang_server

    from areal_cli.modelgen import create_tiny_model, model_summary

    cases = [("tiny", lambda: create_tiny_model(root / "tiny-sglang", seed=0)),
             ("100M", lambda: _m100(root / "sglang", hidden, layers))]  # fmt: skip
    if sglang_python() is None:
        for name, _ in cases:
            print(f"weight_sync_distributed_over_disk[sglang,{name}]: skipped (no SGLang "
                  "build; `make engines`)")  # fmt: skip
        return True
    ok = True
    for name, make in cases:
        model = make()
        params = model_summary(model)["params"]
        print(f"model {name}: {params / 1e6:.2f}M parameters (float32), 1 SGLang replica "
              f"(load {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
        with sglang_server(model, root / f"sglang-{name}", trial=f"sync-{name}") as addr:
            med = _alternate(root / f"sglang-{name}", model, addr, rounds, "sglang", "SGLang")
        ratio = med["distributed"] / med["disk"]
        ok &= report(f"weight_sync_distributed_over_disk[sglang,{name}]", ratio,
                     f"<= {TARGET}", ratio <= TARGET)  # fmt: skip
    return ok


def grpo_benchmark(root: Path, steps: int) -> None:
    from areal_cli.modelgen import create_tiny_model

    model = create_tiny_model(root / "tiny", seed=0)
    proc, addr = _serve(model, root / "grpo-server.log")
    try:
        _wait_healthy(addr, proc)
        for method in ("distributed", "disk"):
            log_dir = root / f"grpo-{method}"
            env = {**os.environ, "AREAL_LLM_SERVER_ADDRS": addr, "AREAL_SERVER_BACKEND": "hf",
                   "AREAL_ALLOC": "fsdp:d2", "AREAL_LOG_DIR": str(log_dir),
                   "OMP_NUM_THREADS": "1"}  # fmt: skip
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   "--master-port", str(_free_port()), str(REPO / "templates/grpo/train.py"),
                   "--config", str(REPO / "templates/grpo/tiny_cpu.yaml"), f"steps={steps}",
                   f"sync_method={method}"]  # fmt: skip
            res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
            if res.returncode != 0:
                raise SystemExit(f"GRPO ({method}) failed:\n{res.stderr[-3000:]}")
            rows = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]
            rows = rows[1:]  # the first step pays for the group's rendezvous / first write
            sync = statistics.median(r["sync_s"] for r in rows)
            step = statistics.median(r["step_time_s"] for r in rows)
            print(f"grpo_sync_share_{method}: {sync / step:.3f}   (sync {sync * 1000:.0f} ms "
                  f"of a {step * 1000:.0f} ms step, tiny model, 2 FSDP ranks)", flush=True)  # fmt: skip
    finally:
        _stop([proc])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--grpo-steps", type=int, default=10)
    ap.add_argument("--only-sglang", action="store_true")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-weight-sync-"))
    try:
        ok = sglang_benchmark(root, args.hidden, args.layers, args.rounds)
        if not args.only_sglang:
            ok &= sync_benchmark(root, args.hidden, args.layers, args.rounds)
            grpo_benchmark(root, args.grpo_steps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
