"""AREAL_HOME on a filesystem that fills up (a real 1 MiB tmpfs, mounted for the test): the
job ends with exit 1 naming that filesystem, its record says what happened, and no empty
temporary file is left behind."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from areal_cli import files
from tests.helpers import FAKE_PYTHON, areal, fill, small_tmpfs

CHATTY = """\
import time
for step in range(60):
    print(f"step {step} " + "x" * 60000, flush=True)
    time.sleep(0.05)
"""


@pytest.fixture
def model(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    return d


@pytest.fixture
def small_fs(tmp_path):
    with small_tmpfs(tmp_path / "small", "1m") as mnt:
        yield mnt


def _tmp_files(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.name.endswith(".tmp")]


def test_training_that_fills_the_home(small_fs, tmp_path):
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    home = small_fs / "home"
    t0 = time.monotonic()
    res = areal("train", "--alloc", "fsdp:d1", "--servers", "none", str(script),
                env={"AREAL_HOME": str(home)}, timeout=120)  # fmt: skip
    took = time.monotonic() - t0
    assert res.returncode == 1, res.stderr[-3000:]
    assert f"tmpfs at {small_fs}" in res.stderr, res.stderr[-2000:]
    assert "is full" in res.stderr or "no space left" in res.stderr
    assert "Traceback" not in res.stderr and "OSError" not in res.stderr
    (rec_path,) = list(home.glob("jobs/*/default/trial0/train.json"))
    record = json.loads(rec_path.read_text())
    assert record["state"] == "failed" and record["exit_code"] == 1, record
    assert "full" in record["message"], record["message"]
    assert _tmp_files(home) == []
    assert not list(home.rglob("*.reserve"))  # given back with the job's end
    print(f"full home: exit 1 after {took:.1f}s", file=sys.stderr)


def test_serve_on_a_full_home(small_fs, tmp_path, model):
    home = small_fs / "home"
    home.mkdir()
    fill(small_fs)
    t0 = time.monotonic()
    res = areal("serve", "--backend", "hf", "--model", str(model), "--python", FAKE_PYTHON,
                env={"AREAL_HOME": str(home)}, timeout=60)  # fmt: skip
    took = time.monotonic() - t0
    assert res.returncode == 1, res.stderr[-3000:]
    assert f"no space left on tmpfs at {small_fs}" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and "OSError" not in res.stderr
    assert _tmp_files(home) == []
    print(f"serve on a full home: exit 1 in {took:.2f}s", file=sys.stderr)


def test_the_last_state_gets_out_on_a_full_disk(small_fs):
    """A live record keeps a reserve; on a full disk it is given back for the final write.
    Without one the write fails as DiskFull and leaves nothing half-written."""
    rec = small_fs / "train.json"
    files.write_atomic(rec, '{"state": "running"}', reserve=True)
    assert (small_fs / ".train.json.reserve").stat().st_size == files.RESERVE_BYTES
    fill(small_fs)
    files.write_atomic(rec, '{"state": "failed", "message": "' + "m" * 3000 + '"}', reserve=False)
    assert json.loads(rec.read_text())["state"] == "failed"
    assert not (small_fs / ".train.json.reserve").exists()
    fill(small_fs)  # the reserve's room is taken again
    with pytest.raises(files.DiskFull) as e:
        files.write_atomic(small_fs / "other.json", "x" * 8192)
    assert f"tmpfs at {small_fs}" in e.value.message
    assert _tmp_files(small_fs) == [] and not (small_fs / "other.json").exists()
    assert json.loads(rec.read_text())["state"] == "failed"  # the old content stands
