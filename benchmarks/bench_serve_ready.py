"""Readiness overhead: `areal serve --backend hf` d2 time-to-ready minus the servers' own time
to a first healthy answer (both started directly, polled every 5 ms). Target ≤ 0.5 s.

With the SGLang CPU build (`make engines`; AREAL_ENGINES, default /var/cache/areal-engines):
`areal serve --backend sglang` d1 minus the engine's own time, the launch command that
`areal serve --dry-run --json` plans run raw until its /health answers, before and after
`areal serve` (the faster counts; the first is also a warm-up): the engine takes half a
minute or more to start here. Without the build it prints a skip line.
"""

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from _common import AREAL, report

from areal_cli.modelgen import create_tiny_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def direct(model: Path) -> float:
    ports = [free_port(), free_port()]
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "areal_cli.server",
                "--model-path",
                str(model),
                "--port",
                str(p),
                "--device",
                "cpu",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for p in ports
    ]
    try:
        pending = set(ports)
        while pending:
            pending = {p for p in pending if not healthy(p)}
            time.sleep(0.005)
        return time.perf_counter() - t0
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()


def via_areal(model: Path, env: dict) -> float:
    t0 = time.perf_counter()
    res = subprocess.run([AREAL, "serve", "--backend", "hf", "--model", str(model), "--alloc",
                          "hf:d2", "--trial", "bench", "--detach"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    if res.returncode:
        sys.exit(f"areal serve failed:\n{res.stderr}")
    took = time.perf_counter() - t0
    subprocess.run([AREAL, "stop", "default/bench"], env=env, check=True, stdout=subprocess.DEVNULL)
    return took


def sglang_python() -> str | None:
    py = Path(os.environ.get("AREAL_ENGINES", "/var/cache/areal-engines")) / "sglang/bin/python"
    return str(py) if py.exists() else None


def sglang_case(model: Path, env: dict, python: str) -> tuple[float, float]:
    """(the engine's own time to healthy, the faster of a try before and one after;
    areal serve's time to ready, between them)."""
    serve = [AREAL, "serve", "--backend", "sglang", "--model", str(model), "--python", python,
             "--trial", "bench-sglang"]  # fmt: skip
    plan = json.loads(subprocess.run([*serve, "--dry-run", "--json"], env=env, check=True,
                                     capture_output=True, text=True).stdout)  # fmt: skip
    proc = plan["processes"][0]
    argv = proc["argv"][proc["argv"].index("--") + 1 :]  # the engine, without the launch wrapper
    raw_env = {**os.environ, **{k: v for k, v in proc["env"].items() if "API_KEY" not in k}}

    def raw() -> float:
        port = free_port()
        argv[argv.index("--port") + 1] = str(port)
        t0 = time.perf_counter()
        engine = subprocess.Popen(argv, env=raw_env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        try:
            while not healthy(port):
                if engine.poll() is not None:
                    sys.exit(f"SGLang exited {engine.returncode} before /health answered")
                time.sleep(0.005)
            return time.perf_counter() - t0
        finally:
            os.killpg(engine.pid, 15)
            engine.wait()

    before = raw()  # also the warm-up: page cache and bytecode of the engine's venv
    t0 = time.perf_counter()
    res = subprocess.run([*serve, "--detach"], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
    took = time.perf_counter() - t0
    subprocess.run([AREAL, "stop", "default/bench-sglang"], env=env, stdout=subprocess.DEVNULL)
    if res.returncode:
        sys.exit(f"areal serve --backend sglang failed:\n{res.stderr[-2000:]}")
    after = raw()
    print(f"  SGLang alone: {before:.2f} s before areal serve, {after:.2f} s after")
    own = min(before, after)
    return own, took


def main() -> int:
    ok = True
    python = sglang_python()
    if python is None:
        print("serve_ready_overhead_s[sglang]: skipped (no SGLang build; `make engines`)")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            model = create_tiny_model(Path(tmp) / "tiny")
            env = {**os.environ, "AREAL_HOME": f"{tmp}/home", "AREAL_REGISTRY": f"{tmp}/reg"}
            own, took = sglang_case(model, env, python)
        print(f"  SGLang alone {own:.2f} s to healthy; areal serve --detach {took:.2f} s to ready")
        ok &= report("serve_ready_overhead_s[sglang]", took - own, "<= 0.5", took - own <= 0.5)
    with tempfile.TemporaryDirectory() as tmp:
        model = create_tiny_model(Path(tmp) / "tiny")
        env = {**os.environ, "AREAL_HOME": f"{tmp}/home", "AREAL_REGISTRY": f"{tmp}/reg"}
        base, ours = [], []
        for _ in range(3):
            base.append(direct(model))
            ours.append(via_areal(model, env))
    b, o = statistics.median(base), statistics.median(ours)
    print(f"  servers alone {b:.2f} s to healthy; areal serve --detach {o:.2f} s to ready")
    report("serve_ready_vs_direct_ratio", o / b, "informational", True)
    ok &= report("serve_ready_overhead_s", o - b, "<= 0.5", o - b <= 0.5)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
