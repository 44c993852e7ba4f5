"""Running the real `areal` console script from tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
AREAL = str(Path(sys.executable).parent / "areal")
FAKE_PYTHON = str(REPO / "tests" / "fixtures" / "fake_python.py")


def areal(
    *args: str,
    env: dict | None = None,
    timeout: float = 60,
    check: int | None = None,
    cwd: str | Path | None = None,
):
    """Run `areal ARGS`; returns CompletedProcess with text stdout/stderr."""
    full_env = {**os.environ, "FAKE_REAL_PYTHON": sys.executable, "COLUMNS": "200"}
    full_env.update(env or {})
    res = subprocess.run(
        [AREAL, *args], capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd
    )
    if check is not None:
        assert res.returncode == check, (
            f"areal {' '.join(args)} exited {res.returncode}, wanted {check}\n"
            f"stdout:\n{res.stdout}\nstderr:\n{res.stderr}"
        )
    return res


def fake_serve_args(model: Path, *extra: str) -> list[str]:
    return ["serve", "--backend", "hf", "--model", str(model), "--python", FAKE_PYTHON, *extra]


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    """predicate()'s first true value within `timeout` seconds; else fail saying `what`."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what} after {timeout:g}s"
        time.sleep(interval)
