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

# Three test workers share this machine's cores with every server and rank they start: one
# OpenMP thread each, or their thread pools spin against each other (about a sixth of the
# suite's CPU time).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Real Slurm and etcd daemons: fixtures and the `slurm` / `etcd` markers (tests/services.py).
pytest_plugins = ["services"]


def our_processes(home: Path) -> list[psutil.Process]:
    """Live processes this test started: pytest's descendants, and anything (daemons,
    orphaned torchrun workers) that inherited this test's private AREAL_HOME."""
    from services import SESSION_DAEMONS

    me = psutil.Process()
    found = {p.pid: p for p in me.children(recursive=True) if p.pid not in SESSION_DAEMONS}
    needle = str(home)
    for p in psutil.process_iter(["pid"]):
        if p.pid in found or p.pid == me.pid:
            continue
        try:
            if p.environ().get("AREAL_HOME", "").startswith(needle):
                found[p.pid] = p
        except psutil.Error:
            continue
    live = []
    for p in found.values():
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                live.append(p)
        except psutil.Error:
            continue
    return live


@pytest.fixture(autouse=True)
def areal_env(tmp_path, monkeypatch):
    home, reg = tmp_path / "home", tmp_path / "registry"
    monkeypatch.setenv("AREAL_HOME", str(home))
    monkeypatch.setenv("AREAL_REGISTRY", str(reg))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    # Tests run in parallel workers (pytest -n): each scans its own range for server ports.
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    # AREAL_TEST_PORT_BASE moves the whole block, for two test runs on one machine at once.
    base = int(os.environ.get("AREAL_TEST_PORT_BASE", "30000"))
    monkeypatch.setenv("AREAL_PORT_BASE", str(base + 2000 * int(worker.removeprefix("gw") or 0)))
    return home, reg


@pytest.fixture(autouse=True)
def no_leaked_processes(request, areal_env):
    """A test that leaves a process behind fails (and its leftovers are killed)."""
    home = areal_env[0]
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    deadline = time.monotonic() + 5
    left = [p for p in our_processes(home) if p.pid not in before]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in our_processes(home) if p.pid not in before]
    if left:
        desc = [f"{p.pid}: {' '.join(p.cmdline())[:120]}" for p in left if p.is_running()]
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        if desc:
            pytest.fail("test left processes behind:\n" + "\n".join(desc))


def pytest_sessionfinish(session, exitstatus):
    """Module- and session-scoped fixtures must clean up too: nothing outlives the run."""
    try:
        base = session.config._tmp_path_factory.getbasetemp()
    except Exception:
        return
    time.sleep(0.5)
    left = our_processes(base)
    if left:
        for p in left:
            try:
                sys.stderr.write(
                    f"\nleft behind after the test run: {p.pid} {' '.join(p.cmdline())[:120]}"
                )
                p.kill()
            except psutil.Error:
                pass
        session.exitstatus = 1


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA; torch is imported only when such a test was collected."""
    gpu_items = [i for i in items if i.get_closest_marker("gpu")]
    if not gpu_items:
        return
    # Without a driver's device node (Linux, or WSL's) there is no CUDA: spare every worker
    # torch's import.
    if not any(Path(d).exists() for d in ("/dev/nvidiactl", "/dev/dxg")):
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason="needs CUDA (no NVIDIA device node)"))
        return
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in gpu_items:
            item.add_marker(skip)
