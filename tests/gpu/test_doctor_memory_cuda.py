"""`areal doctor memory` on a CUDA rank: torch's allocator over the doctor channel and its
memory snapshot in the format pytorch.org/memory_viz reads. Marked `gpu`."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from test_doctor_hang import AREAL, launch, leftovers  # noqa: E402

pytestmark = pytest.mark.gpu


def test_cuda_allocator_and_snapshot(tmp_path):
    s = launch("cuda_memory", 1, tmp_path)
    try:
        s.wait_alive()
        time.sleep(5)  # CUDA initialised, the tensor allocated
        env = {"AREAL_HOME": str(tmp_path / "home")}
        res = subprocess.run(
            [AREAL, "doctor", "memory", "--pid", str(s.proc.pid), "--json",
             "--snapshot", str(tmp_path / "snap")],
            capture_output=True, text=True, timeout=120, env={**os.environ, **env},
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        data = json.loads(res.stdout)
        (rank,) = data["ranks"]
        cuda = rank["cuda"]
        assert cuda["allocated"] >= 256 << 20 and cuda["reserved"] >= cuda["allocated"]
        assert cuda["peak_allocated"] >= cuda["allocated"] and cuda["total"] > cuda["reserved"]
        assert data["most"]["what"] == "cuda reserved" and data["most"]["rank"] == 0
        (snap,) = data["snapshots"]
        assert snap["kind"] == "cuda_snapshot"
        with open(snap["path"], "rb") as f:
            dumped = pickle.load(f)
        assert "segments" in dumped and "device_traces" in dumped
        assert sum(seg["total_size"] for seg in dumped["segments"]) >= 256 << 20
    finally:
        t = threading.Thread(target=s.stop)
        t.start()
        t.join()
        assert not leftovers()
