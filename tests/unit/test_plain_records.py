"""The records `areal ps` reads are plain classes (areal_cli.plain), not dataclasses: files the
dataclass versions wrote still load, and come back out the same, key for key and in order."""

from __future__ import annotations

import copy
import json
import pickle

import pytest

from areal_cli.errors import UsageError
from areal_cli.schedulers.api import Handle, JobStatus, RunOpt, ServerStatus, StopResult
from areal_cli.schedulers.local import records
from areal_cli.schedulers.ray.records import RayRecord
from areal_cli.schedulers.ray.records import read as ray_read
from areal_cli.schedulers.slurm.records import SlurmRecord
from areal_cli.schedulers.slurm.records import read as slurm_read
from areal_cli.schedulers.slurm.records import write as slurm_write

# What the dataclass versions wrote (json.dumps of dataclasses.asdict, and of to_json).
LOCAL = """{"experiment": "e", "trial": "t", "kind": "serve", "state": "running", "marker": \
"areal-m", "supervisor_pid": 1, "supervisor_create_time": 2.5, "host": "h", "started": 3.0, \
"log_dir": "/l", "registry": "/r", "alloc": null, "model": null, "processes": [{"role": \
"server", "index": 0, "pid": 5, "argv": ["a"], "log": "/l/s.log", "addr": "127.0.0.1:1", \
"gpus": [0], "create_time": null, "exit_code": null, "server_pid": null, \
"server_create_time": null}], "api_key_file": null, "message": null, "detail": null, \
"exit_code": null, "updated": 0.0, "watchdog": {"kind": "x"}, "restarts": [{"line": "y"}]}"""
SLURM = """{"experiment": "e", "trial": "t", "kind": "train", "job_id": "7", "marker": "m", \
"state": "pending", "submitted": 1.0, "log_dir": "/l", "registry": "/r", "run_dir": "/run", \
"alloc": null, "model": null, "replicas": 0, "world_size": 0, "nodes": ["n1"], "reason": null, \
"api_key_file": null, "message": null, "detail": null, "exit_code": null, "started": null, \
"updated": 0.0, "slurm_state": "PENDING"}"""
RAY = """{"experiment": "e", "trial": "t", "kind": "train", "job_id": "7", "marker": "m", \
"state": "pending", "submitted": 1.0, "log_dir": "/l", "registry": "/r", "run_dir": "/run", \
"alloc": null, "model": null, "replicas": 0, "world_size": 0, "nodes": [], "reason": null, \
"api_key_file": null, "message": null, "detail": null, "exit_code": null, "started": null, \
"updated": 0.0, "address": "", "actors": ["a"], "group": null, "node_ids": {"x": "y"}}"""
STATUS = """{"name": "e/t", "experiment": "e", "trial": "t", "kind": "serve", "scheduler": \
"local", "job_id": null, "state": "running", "host": null, "nodes": [], "pids": [], \
"servers": [{"addr": "a:1", "healthy": true, "pid": null, "gpus": [1], "node": null, \
"paused": false, "exit_code": null, "errors": null, "restarts": 0}], "started": 0.0, \
"log_dir": null, "alloc": null, "model": null, "message": null, "exit_code": null, \
"ranks_alive": null, "world_size": null, "reason": null, "marker": null, "registry": null, \
"watchdog": null, "restarts": []}"""
STOP = """{"name": "e/t", "was_running": true, "killed": 2, "deregistered": 0, "cancelled": \
null, "left": [], "running": false}"""


def test_a_local_record_written_before_loads_and_writes_back_the_same(tmp_path):
    path = tmp_path / "serve.json"
    path.write_text(LOCAL)
    path.chmod(0o600)
    rec = records.read(path)
    assert rec.processes[0].addr == "127.0.0.1:1" and rec.watchdog == {"kind": "x"}
    out = rec.to_json()
    # Another host's running job: taken as alive (its supervisor is not this host's to ask).
    assert [out.pop(k) for k in ("name", "pids", "alive")] == ["e/t", [5], True]
    assert json.dumps(out) == LOCAL
    assert records.JobRecord.from_json(rec.to_json()) == rec


def test_a_local_record_of_an_older_release_gets_the_defaults(tmp_path):
    old = json.loads(LOCAL)
    for newer in ("model", "watchdog", "restarts"):
        del old[newer]
    del old["processes"][0]["server_pid"]
    rec = records.JobRecord.from_json(old)
    assert (rec.model, rec.watchdog, rec.restarts) == (None, None, [])
    assert rec.processes[0].server_pid is None


def test_a_record_with_a_field_this_release_lacks_is_corrupt(tmp_path):
    path = tmp_path / "serve.json"
    path.write_text(json.dumps({**json.loads(LOCAL), "unheard_of": 1}))
    path.chmod(0o600)
    with pytest.raises(UsageError, match="corrupt or half-written"):
        records.read(path)


@pytest.mark.parametrize("text, read", [(SLURM, slurm_read), (RAY, ray_read)])
def test_cluster_records_written_before_load_and_dump_the_same(tmp_path, text, read):
    path = tmp_path / "train.json"
    path.write_text(text)
    path.chmod(0o600)
    rec = read(path)
    assert rec.name == "e/t" and rec.live
    assert json.dumps(rec.to_json()) == text


def test_a_cluster_record_round_trips_through_its_writer(tmp_path):
    rec = SlurmRecord(**{**json.loads(SLURM), "slurm_state": "RUNNING"})
    slurm_write(tmp_path, rec)
    back = slurm_read(tmp_path / "slurm" / records.settings.user() / "e" / "t" / "train.json")
    assert back == rec and back.slurm_state == "RUNNING" and back.updated > 0
    assert RayRecord(**json.loads(RAY)) != RayRecord(**{**json.loads(RAY), "group": "g"})


def test_status_and_stop_result_json_are_as_before():
    status = JobStatus(Handle("local", "e", "t", "serve"), "running",
                       servers=[ServerStatus("a:1", True, gpus=[1])])  # fmt: skip
    assert json.dumps(status.to_json()) == STATUS
    assert json.dumps(StopResult("e/t", True, 2).to_json()) == STOP


def test_json_is_a_copy_not_the_records_own_lists():
    rec = records.JobRecord.from_json(json.loads(LOCAL))
    out = rec.to_json()
    out["processes"][0]["gpus"].append(9)
    out["restarts"].append({})
    assert rec.processes[0].gpus == [0] and rec.restarts == [{"line": "y"}]


def test_defaults_are_not_shared_between_records():
    a, b = StopResult("e/t", True), StopResult("e/t", True)
    a.left.append("x")
    assert b.left == [] and a != b


def test_handles_are_frozen_hashable_and_travel():
    h = Handle("slurm", "e", "t", "train", "58")
    assert str(h) == "slurm://e/t/train#58" and h.name == "e/t"
    assert {h: 1}[Handle("slurm", "e", "t", "train", "58")] == 1
    assert h != Handle("slurm", "e", "t", "train")
    with pytest.raises(AttributeError):
        h.kind = "serve"
    for back in (pickle.loads(pickle.dumps(h)), copy.deepcopy(h), copy.copy(h)):
        assert back == h and hash(back) == hash(h)
    opt = RunOpt("partition", "str", "Slurm partition", "--partition")
    assert len({opt, RunOpt("partition", "str", "Slurm partition", "--partition")}) == 1
    assert "flag='--partition'" in repr(opt)


def test_unhashable_as_a_mutable_dataclass_is():
    with pytest.raises(TypeError):
        hash(StopResult("e/t", True))
