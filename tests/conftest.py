"""Every test gets its own AREAL_HOME and registry, and fails if it leaves a process behind."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
AREAL = str(VENV_BIN / "areal")
# Process names that belong to this project; a live one created by a test is a leak.
OURS = ("areal_cli", "torch.distributed.run", "areal ", "fake_python", "tests/scenarios")


def our_processes(since: float) -> list[psutil.Process]:
    me = os.getpid()
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "create_time", "status"]):
        try:
            if p.pid == me or p.info["create_time"] < since - 0.5:
                continue
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(p.info["cmdline"] or [])
            env_marked = False
            try:
                env_marked = "AREAL_JOB_MARKER" in p.environ()
            except psutil.Error:
                pass
            if env_marked or any(o in cmd for o in OURS):
                found.append(p)
        except psutil.Error:
            continue
    return found


@pytest.fixture(autouse=True)
def areal_env(tmp_path, monkeypatch):
    home, reg = tmp_path / "home", tmp_path / "registry"
    monkeypatch.setenv("AREAL_HOME", str(home))
    monkeypatch.setenv("AREAL_REGISTRY", str(reg))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return home, reg


@pytest.fixture(autouse=True)
def no_leaked_processes(request):
    """A test that leaves a process behind fails (and its leftovers are killed)."""
    start = time.time()
    yield
    if request.node.get_closest_marker("allow_module_processes"):
        return
    deadline = time.monotonic() + 5
    left = our_processes(start)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = our_processes(start)
    if left:
        desc = [f"{p.pid}: {' '.join(p.cmdline())[:120]}" for p in left if p.is_running()]
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        if desc:
            pytest.fail("test left processes behind:\n" + "\n".join(desc))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "allow_module_processes: processes are owned by a module fixture"
    )
