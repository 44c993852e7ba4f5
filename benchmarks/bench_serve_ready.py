"""Readiness overhead: `areal serve --backend hf` d2 time-to-ready minus the servers' own time
to a first healthy answer (both started directly, polled every 5 ms). Target ≤ 0.5 s."""

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


def main() -> int:
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
    return 0 if report("serve_ready_overhead_s", o - b, "<= 0.5", o - b <= 0.5) else 1


if __name__ == "__main__":
    sys.exit(main())
