"""areal_cli.worker.checkpoint with real ranks: torchrun, two gloo ranks, an FSDP2 tiny model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.helpers import wait_for

WORKER = Path(__file__).with_name("checkpoint_worker.py")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from areal_cli.modelgen import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=0)


def _start(tiny: Path, out: Path, mode: str) -> subprocess.Popen:
    env = {**os.environ, "AREAL_LOG_DIR": str(out / "logs"), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}  # fmt: skip
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", str(WORKER), str(tiny), str(out), mode]  # fmt: skip
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip


def _stop(proc: subprocess.Popen) -> None:
    """torchrun and its ranks (each rank is in a session of its own)."""
    if proc.poll() is not None:
        return
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    for p in [psutil.Process(proc.pid), *tree]:
        try:
            p.kill()
        except psutil.Error:
            pass
    proc.communicate()


def _run(tiny: Path, out: Path, mode: str) -> list[dict]:
    proc = _start(tiny, out, mode)
    try:
        output, _ = proc.communicate(timeout=400)
    finally:
        _stop(proc)
    assert proc.returncode == 0, output[-4000:]
    return [json.loads((out / f"{mode}-rank{r}.json").read_text()) for r in range(2)]


def test_a_background_save_holds_the_state_at_the_call_and_loads_back_exactly(tiny, tmp_path):
    ranks = _run(tiny, tmp_path, "roundtrip")
    for r in ranks:
        # The optimizer step taken while the save was written changed every tensor ...
        assert r["moved"] > 0
        # ... and the checkpoint holds them as they were at the call: parameters and AdamW
        # state (exp_avg, exp_avg_sq, step) equal bit for bit, in a fresh model and optimizer.
        assert r["latest_after_wait"] == r["loaded_step"] == 2
        assert r["differences"] == [], r["differences"][:5]
        assert r["loaded_extra"] == {"data": 16}
        # Each rank's RNG streams (torch, Python, NumPy) go on where they were at the save.
        assert r["draws_equal"]
    # Saves of steps 3, 4 and 5 (4 in the foreground) with keep=2: the last two are kept,
    # and nothing half-written or half-removed is left beside them.
    r0 = ranks[0]
    assert r0["kept"] == [4, 5] and r0["entries"] == ["step-4", "step-5"]
    for path, mode in r0["modes"].items():
        is_dir = "/" not in path
        assert mode == ("0o700" if is_dir else "0o600"), (path, mode)


def test_a_save_killed_while_writing_leaves_the_previous_checkpoint_as_latest(tiny, tmp_path):
    from areal_cli.worker.checkpoint import latest

    root = tmp_path / "logs" / "checkpoints"
    proc = _start(tiny, tmp_path, "interrupt")
    try:
        # Rank 1 stops half way through writing step 2 (the test's planner) and says so.
        wait_for(lambda: (tmp_path / "writing").exists() or proc.poll() is not None, 400,
                 "rank 1 never started writing step 2")  # fmt: skip
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        assert any((root / ".step-2.tmp").iterdir())
        os.kill(int((tmp_path / "writing").read_text()), signal.SIGKILL)
        output, _ = proc.communicate(timeout=120)  # torchrun stops rank 0 and fails
        assert proc.returncode != 0, output[-3000:]
    finally:
        _stop(proc)
    assert latest(root).step == 1
    assert (root / ".step-2.tmp").is_dir()  # what the killed save wrote, never read
    for r in _run(tiny, tmp_path, "resume"):
        # The next run clears the half-written save and resumes from step 1, exactly.
        assert r["entries_after_start"] == ["step-1"]
        assert r["loaded_step"] == 1
        assert r["differences"] == [], r["differences"][:5]
