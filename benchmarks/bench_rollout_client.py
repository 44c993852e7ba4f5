"""RolloutClient throughput against a bare aiohttp client, same stub server, same run.

    python benchmarks/bench_rollout_client.py [--requests 600] [--concurrency 64]

A minimal SGLang-style `/generate` stub runs in a subprocess. The baseline posts the same
payload with one aiohttp session and a semaphore and decodes the JSON; RolloutClient does
the same plus server choice, failover bookkeeping and response parsing. Rounds alternate
and the median of the
per-pair ratios counts, so background load hurts both alike.

Prints `rollout_client_throughput: <client / baseline>`; exits 1 below the target (0.8).

With the SGLang CPU build (`make engines`), the same against real SGLang (one replica of the
tiny model under `areal serve`): the baseline posts the very requests the client sends
(built by backends/protocol_sglang.py, 16 tokens each, ignore_eos so both sides generate
alike) and decodes the JSON. Prints `rollout_client_throughput[sglang]` (target 0.95);
without the build, a skip line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

TARGET = 0.8
TARGET_SGLANG = 0.95
MAX_NEW_TOKENS = 16


def serve(port: int) -> None:
    from aiohttp import web

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        n = body["sampling_params"]["max_new_tokens"]
        out = [(body["input_ids"][-1] + i) % 256 for i in range(n)]
        return web.json_response(
            {
                "text": "",
                "output_ids": out,
                "meta_info": {
                    "output_token_logprobs": [[-0.5, t, None] for t in out],
                    "finish_reason": {"type": "length", "length": n},
                    "weight_version": "0",
                },
            }
        )

    app = web.Application()
    app.router.add_post("/generate", generate)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"stub server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise SystemExit("stub server did not start")


def _prompts(n: int) -> list[list[int]]:
    return [[1 + (i % 200), 2, 3, 4, 5, 6, 7, 8] for i in range(n)]


async def raw_round(addr: str, prompts: list[list[int]], concurrency: int) -> float:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    sampling = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:

        async def one(ids: list[int]) -> list[int]:
            async with sem:
                payload = {"input_ids": ids, "sampling_params": sampling, "return_logprob": True}
                async with s.post(f"http://{addr}/generate", json=payload) as resp:
                    return (await resp.json())["output_ids"]

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        elapsed = time.perf_counter() - t0
    assert len(results) == len(prompts)
    return len(prompts) / elapsed


async def client_round(addr: str, prompts: list[list[int]], concurrency: int) -> float:
    from areal_cli.worker.rollout import RolloutClient

    async with RolloutClient([addr], backend="sglang", max_concurrency=concurrency) as client:
        t0 = time.perf_counter()
        groups = await client.generate_batch(prompts, max_new_tokens=MAX_NEW_TOKENS)
        elapsed = time.perf_counter() - t0
    assert len(groups) == len(prompts) and len(groups[0][0].output_ids) == MAX_NEW_TOKENS
    return len(prompts) / elapsed


async def raw_engine_round(addr: str, prompts: list[list[int]], concurrency: int) -> float:
    """The client's own requests (protocol_sglang builds them), posted with bare aiohttp."""
    import aiohttp

    from areal_cli.backends import protocol_sglang as proto

    sampling = proto.sampling_params(MAX_NEW_TOKENS, ignore_eos=True)
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:

        async def one(ids: list[int]) -> list[int]:
            path, payload = proto.generate_request(ids, sampling)
            async with sem, s.post(f"http://{addr}{path}", json=payload) as resp:
                return (await resp.json())["output_ids"]

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        elapsed = time.perf_counter() - t0
    assert all(len(r) == MAX_NEW_TOKENS for r in results), results[0]
    return len(prompts) / elapsed


async def client_engine_round(addr: str, prompts: list[list[int]], concurrency: int) -> float:
    from areal_cli.worker.rollout import RolloutClient

    async with RolloutClient([addr], backend="sglang", max_concurrency=concurrency) as client:
        t0 = time.perf_counter()
        groups = await client.generate_batch(
            prompts, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True
        )
        elapsed = time.perf_counter() - t0
    assert all(len(g[0].output_ids) == MAX_NEW_TOKENS for g in groups)
    return len(prompts) / elapsed


def sglang_case(requests: int, concurrency: int, rounds: int) -> bool:
    """RolloutClient ÷ bare aiohttp against real SGLang, interleaved pairs, median ratio."""
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from _engines import sglang_python, sglang_server

    from areal_cli.modelgen import create_tiny_model

    if sglang_python() is None:
        print("rollout_client_throughput[sglang]: skipped (no SGLang build; `make engines`)")
        return True
    with tempfile.TemporaryDirectory() as tmp:
        model = create_tiny_model(Path(tmp) / "tiny", seed=0)
        with sglang_server(model, Path(tmp)) as addr:
            prompts = _prompts(requests)
            raw, ours = [], []

            async def bench() -> None:
                await raw_engine_round(addr, prompts[:32], concurrency)  # warm up both sides
                await client_engine_round(addr, prompts[:32], concurrency)
                for i in range(rounds):
                    pair = [raw_engine_round, client_engine_round][:: -1 if i % 2 else 1]
                    for fn in pair:
                        (raw if fn is raw_engine_round else ours).append(
                            await fn(addr, prompts, concurrency)
                        )

            asyncio.run(bench())
    ratio = statistics.median(o / r for o, r in zip(ours, raw, strict=True))
    print(
        f"  SGLang, raw aiohttp: {statistics.median(raw):.1f} req/s · RolloutClient: "
        f"{statistics.median(ours):.1f} req/s (medians of {len(raw)} rounds of {requests}, "
        f"{concurrency} at once, {MAX_NEW_TOKENS} tokens each; load {os.getloadavg()[0]:.1f})"
    )
    print(f"rollout_client_throughput[sglang]: {ratio:.3f}   (target >= {TARGET_SGLANG})")
    return ratio >= TARGET_SGLANG


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--sglang-requests", type=int, default=64)
    parser.add_argument("--sglang-concurrency", type=int, default=16)
    parser.add_argument("--sglang-rounds", type=int, default=6)
    parser.add_argument("--only-sglang", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return 0
    engine_ok = sglang_case(args.sglang_requests, args.sglang_concurrency, args.sglang_rounds)
    if args.only_sglang:
        return 0 if engine_ok else 1

    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port)],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_listening(port, proc)
        addr = f"127.0.0.1:{port}"
        prompts = _prompts(args.requests)
        raw, ours = [], []

        async def bench() -> None:
            await raw_round(addr, prompts[:200], args.concurrency)  # warm up both sides
            await client_round(addr, prompts[:200], args.concurrency)
            for i in range(args.rounds):
                # Alternate who goes first, so neither side always follows the other's
                # leftovers (server-side garbage, warm connections).
                if i % 2:
                    ours.append(await client_round(addr, prompts, args.concurrency))
                    raw.append(await raw_round(addr, prompts, args.concurrency))
                else:
                    raw.append(await raw_round(addr, prompts, args.concurrency))
                    ours.append(await client_round(addr, prompts, args.concurrency))

        asyncio.run(bench())
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)

    # Each pair ran back to back, so a pair's ratio sees the same background load; the
    # median over pairs ignores the pairs a burst of other work landed on.
    ratio = statistics.median(o / r for o, r in zip(ours, raw, strict=True))
    print(
        f"raw aiohttp: {statistics.median(raw):.0f} req/s · "
        f"RolloutClient: {statistics.median(ours):.0f} req/s (medians of {len(raw)} rounds)"
    )
    print(f"rollout_client_throughput: {ratio:.3f}")
    return 0 if ratio >= TARGET and engine_ok else 1


if __name__ == "__main__":
    sys.exit(main())
