import json
import os
import time

import pytest

from areal_cli import gpus
from areal_cli.errors import UsageError
from areal_cli.schedulers.local import records as jobs

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")


def record(kind="serve", pid=None, state="running"):
    from areal_cli import procs, settings

    pid = pid or os.getpid()
    return jobs.JobRecord(
        experiment="e", trial="t", kind=kind, state=state, marker="m", supervisor_pid=pid,
        supervisor_create_time=procs.create_time(pid), host=settings.hostname(),
        started=time.time(), log_dir="/tmp", registry="/tmp",
    )  # fmt: skip


def test_records_round_trip_and_slots(tmp_path):
    jobs.write(tmp_path, record("serve"))
    jobs.write(tmp_path, record("train"))
    assert [r.kind for r in jobs.load_all(tmp_path, "e", "t")] == ["train", "serve"]
    assert jobs.load(tmp_path, "e", "t").kind == "train"
    assert jobs.load(tmp_path, "e", "t", "serve").kind == "serve"


def test_same_kind_refused_other_kind_allowed(tmp_path):
    jobs.write(tmp_path, record("serve"))
    with pytest.raises(UsageError, match="already running"):
        jobs.refuse_if_running(tmp_path, "e", "t", "serve")
    jobs.refuse_if_running(tmp_path, "e", "t", "train")
    with pytest.raises(UsageError):
        jobs.refuse_if_running(tmp_path, "e", "t", "serve+train")


def test_corrupt_record_is_a_usage_error_and_listed_as_bad(tmp_path):
    path = jobs.record_path(tmp_path, "e", "t", "serve")
    path.parent.mkdir(parents=True)
    path.write_text('{"experiment": "e", "tri')
    with pytest.raises(UsageError, match="corrupt or half-written"):
        jobs.load(tmp_path, "e", "t")
    records, bad = jobs.list_all(tmp_path)
    assert records == [] and bad == [str(path)]
    path.write_text(json.dumps({"experiment": "e"}))
    with pytest.raises(UsageError, match="corrupt"):
        jobs.load(tmp_path, "e", "t")
    # A corrupt record of a dead job does not block a new one.
    jobs.refuse_if_running(tmp_path, "e", "t", "serve")


def test_dead_supervisor_is_not_alive(tmp_path):
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    rec = record(pid=p.pid)
    p.wait()
    assert not rec.alive()


def test_gpu_sources(monkeypatch):
    assert gpus.detect("0,2-3").ids == [0, 2, 3]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert gpus.detect().ids == [4, 5] and gpus.detect().source == "CUDA_VISIBLE_DEVICES"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpus.detect().ids == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("PATH", FIXTURES + os.pathsep + os.environ["PATH"])
    inv = gpus.detect()
    assert inv.source == "nvidia-smi" and inv.ids == [0, 1, 2, 3]
    assert inv.gpus[0].name == "NVIDIA H100 80GB HBM3" and inv.gpus[0].memory_total_mib == 81559
    with pytest.raises(UsageError):
        gpus.parse_gpu_list("0,0")


def test_uuid_visible_devices_are_handed_on_as_uuids(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5f3a,GPU-77b1")
    inv = gpus.detect()
    assert inv.ids == [0, 1] and inv.visible([1]) == "GPU-77b1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert gpus.detect().visible([6]) == "6"
