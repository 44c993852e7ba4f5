"""`python -m areal_cli.server`: the hf reference inference server.

    python -m areal_cli.server --model-path ./tiny --port 30000
    AREAL_SERVER_API_KEY=secret python -m areal_cli.server --model-path ./tiny --port 0 --seed 1

The port is bound before the model loads, so /health answers 503 at once and 200 when the
server is ready; then one line "ready: model=... on DEVICE at URL" goes to stdout.
SIGTERM or SIGINT aborts running generation and exits 0 within about a second.

The API key comes from the environment (AREAL_SERVER_API_KEY, removed from it once read) or
a file readable by its owner only (--api-key-file), never from a command line that every
local user reads in /proc/PID/cmdline; --api-key KEY remains for a quick manual try.

Endpoints are listed in `app.py`; sampling and logprob semantics in `engine.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import stat
import sys
import time
from typing import Any

from aiohttp import web

from areal_cli.server.app import ServerState, build_app
from areal_cli.server.batcher import Batcher, TorchWorker
from areal_cli.server.engine import Engine

log = logging.getLogger("areal.server")

KEY_ENV = "AREAL_SERVER_API_KEY"
EXIT_USAGE = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m areal_cli.server",
        description="Reference inference server (transformers, CPU or one GPU) speaking the "
        "SGLang-native HTTP subset plus OpenAI /v1/completions.",
    )
    p.add_argument("--model-path", required=True, help="HF checkpoint directory or hub id")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port")
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (visible in ps: prefer --api-key-file or "
        f"{KEY_ENV})",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        help="read the key from this file, which only its owner may read (mode 600)",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="torch intra-op threads on CPU (default: 1 for models under 50M parameters)",
    )
    p.add_argument("--seed", type=int, default=None, help="make sampling reproducible")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument(
        "--batch-window-ms",
        type=float,
        default=5.0,
        help="how long the first request of a batch waits for company",
    )
    p.add_argument("--revision", default=None, help="branch, tag or commit of a hub id")
    p.add_argument("--served-model-name", default=None, help="model id for /v1 (default: path)")
    p.add_argument(
        "--weight-version",
        default="default",
        help="version label of the weights it starts with (SGLang's default: 'default')",
    )
    p.add_argument(
        "--weight-sync-timeout",
        type=float,
        default=600.0,
        help="seconds a weight-update group waits for its rendezvous or one broadcast",
    )
    p.add_argument(
        "--pause-timeout",
        type=float,
        default=120.0,
        help="a pause that no control request follows for this many seconds ends by itself "
        "(a trainer that died mid-sync); 0 never ends one",
    )
    args = p.parse_args(argv)
    if not args.pause_timeout >= 0:
        p.error(f"--pause-timeout {args.pause_timeout:g} is not a number of seconds >= 0")
    return args


class ApiKeyError(Exception):
    """The API key could not be read as asked."""


def read_api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else --api-key-file (a regular file of ours that nobody else may read),
    else AREAL_SERVER_API_KEY (taken out of the environment)."""
    from_env = os.environ.pop(KEY_ENV, None)
    if args.api_key:
        return args.api_key
    if args.api_key_file:
        path = args.api_key_file
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            raise ApiKeyError(f"cannot open --api-key-file {path}: {e.strerror or e}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ApiKeyError(f"--api-key-file {path} is not a regular file")
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise ApiKeyError(
                    f"--api-key-file {path} must belong to this user and be readable by it "
                    f"only (chmod 600), not mode {stat.S_IMODE(st.st_mode):o}"
                )
            key = os.read(fd, 4096).decode().strip()
        finally:
            os.close(fd)
        if not key:
            raise ApiKeyError(f"--api-key-file {path} is empty")
        return key
    return from_env or None


async def serve(args: argparse.Namespace) -> int:
    state, torch_worker = _server_state(args)
    runner = web.AppRunner(build_app(state), access_log=None, shutdown_timeout=1.0)
    url = await _listen(runner, args, state)
    if url is None:
        return 1
    log.info("listening at %s; loading %s", url, args.model_path)
    code = await _load_and_serve(args, state, torch_worker, url)
    await runner.cleanup()
    return code


def _server_state(args: argparse.Namespace) -> tuple[ServerState, TorchWorker]:
    """The engine (not loaded yet), its batcher and what the routes share."""
    engine = Engine(
        args.model_path,
        device=args.device,
        dtype=args.dtype,
        cpu_threads=args.cpu_threads,
        revision=args.revision,
    )
    torch_worker = TorchWorker()
    batcher = Batcher(
        engine,
        torch_worker,
        max_batch_size=args.max_batch_size,
        batch_window_s=args.batch_window_ms / 1000,
        seed=args.seed,
        weight_version=args.weight_version,
    )
    # /server_info shows the launch arguments under SGLang's names (server_args fields).
    secret = ("api_key", "api_key_file", "seed")
    public_args = {k: v for k, v in vars(args).items() if k not in secret}
    public_args["random_seed"] = args.seed
    state = ServerState(
        engine=engine,
        batcher=batcher,
        args=public_args,
        served_model_name=args.served_model_name or args.model_path,
        api_key=args.api_key,
        pause_timeout=args.pause_timeout,
    )
    return state, torch_worker


async def _listen(
    runner: web.AppRunner, args: argparse.Namespace, state: ServerState
) -> str | None:
    """Bind the port (before the model loads: /health answers 503 meanwhile); its URL, or
    None when the address cannot be bound."""
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, reuse_address=True)
    try:
        await site.start()
    except OSError as e:
        log.error("cannot listen on %s:%s: %s", args.host, args.port, e)
        await runner.cleanup()
        return None
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    state.args["port"] = port
    return f"http://{_url_host(args.host)}:{port}"


async def _load_and_serve(
    args: argparse.Namespace, state: ServerState, torch_worker: TorchWorker, url: str
) -> int:
    """Load the model, then serve until SIGTERM or SIGINT (0) or a failed load (1); running
    generation stops at its next step and waiting clients get an 'abort' answer."""
    engine, batcher = state.engine, state.batcher
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def load() -> None:
        started = time.perf_counter()
        await torch_worker.run(engine.load)
        state.ready = True
        log.info(
            "ready: model=%s on %s at %s (loaded in %.1fs)",
            args.model_path,
            engine.device,
            url,
            time.perf_counter() - started,
        )
        await batcher.run()

    serving = asyncio.create_task(load())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({serving, stopper}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if serving.done() and not serving.cancelled() and serving.exception() is not None:
        exc = serving.exception()
        log.error("cannot load %s: %s: %s", args.model_path, type(exc).__name__, exc)
        code = 1
    else:
        log.info("shutting down")
    state.ready = False
    await batcher.close()
    if state.updates is not None:
        state.updates.close()
    if state.lease is not None:
        state.lease.close()
    for task in (serving, stopper):
        task.cancel()
    await asyncio.gather(serving, stopper, return_exceptions=True)
    return code


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def main(argv: list[str] | None = None) -> None:
    # Until the event loop takes the signals over, a stop request during start-up still exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sys.exit(0))
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    logging.getLogger("aiohttp").setLevel(logging.WARNING)
    args = parse_args(argv)
    try:
        args.api_key = read_api_key(args)
    except ApiKeyError as e:
        log.error("%s", e)
        sys.exit(EXIT_USAGE)
    code: Any = asyncio.run(serve(args))
    sys.stdout.flush()
    sys.exit(code)


if __name__ == "__main__":
    main()
