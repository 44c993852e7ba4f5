"""Running the real `areal` console script from tests."""

from __future__ import annotations

import contextlib
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


def live_with_home(home: Path) -> list:
    """Live processes (psutil, zombies left out) whose environment carries AREAL_HOME=`home`:
    all that `areal` started for that home, whatever their parent now is."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("AREAL_HOME") == str(home):
                if p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
        except psutil.Error:
            continue
    return found


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    """predicate()'s first true value within `timeout` seconds; else fail saying `what`."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what} after {timeout:g}s"
        time.sleep(interval)


@contextlib.contextmanager
def small_tmpfs(mnt: Path, size: str):
    """A tmpfs of `size` mounted at `mnt` for the test's life (skips where mounting is not
    permitted); unmounted after, lazily when something still holds it."""
    import pytest

    mnt.mkdir(parents=True, exist_ok=True)
    try:
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                             capture_output=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        pytest.skip("cannot run mount")
    if res.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {res.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(mnt: Path) -> None:
    """Write into `mnt` until its filesystem is full."""
    fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            os.write(fd, b"x" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
