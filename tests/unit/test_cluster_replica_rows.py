"""`areal ps` rows of a cluster job's replicas, the same on Slurm and Ray (ClusterScheduler):
a replica that registered once (its runner's ready file) but is out of discovery now, as
while its runner starts a killed server again, stays listed, unhealthy, and the job does not
fall back to "starting"; entries come in replica order, then the ended replicas."""

from __future__ import annotations

import json

import pytest

from areal_cli.registry.api import ServerEntry
from areal_cli.schedulers.ray import RayScheduler
from areal_cli.schedulers.ray.records import RayRecord
from areal_cli.schedulers.slurm import SlurmScheduler


def _record(tmp_path, replicas: int) -> RayRecord:
    run = tmp_path / "run"
    run.mkdir()
    return RayRecord("e", "t", "serve", "j1", "m", "running", 0.0, str(tmp_path), "", str(run),
                     replicas=replicas)  # fmt: skip


def _ready(rec, index: int, addr: str) -> None:
    with open(f"{rec.run_dir}/server-{index}.ready", "w") as f:
        json.dump({"addr": addr, "node": "n1", "pid": 1}, f)


def _entry(addr: str) -> ServerEntry:
    return ServerEntry(id=addr, addr=addr, experiment="e", trial="t")


@pytest.mark.parametrize("cls", [RayScheduler, SlurmScheduler])
def test_a_replica_out_of_discovery_while_it_heals_keeps_its_row(cls, tmp_path):
    rec = _record(tmp_path, 2)
    _ready(rec, 0, "10.0.0.1:30000")
    _ready(rec, 1, "10.0.0.2:30001")
    # server-0 is out of discovery (its runner starts it again); server-1 is registered.
    rows, shown = cls(home=tmp_path)._replica_rows(
        rec, [_entry("10.0.0.2:30001")], {}, {"10.0.0.2:30001": True}, {}
    )
    assert [(r.addr, r.healthy) for r in rows] == [("10.0.0.2:30001", True),
                                                   ("10.0.0.1:30000", False)]  # fmt: skip
    assert shown == 2  # both registered once: the job is running, not starting


@pytest.mark.parametrize("cls", [RayScheduler, SlurmScheduler])
def test_entries_in_replica_order_then_the_ended(cls, tmp_path):
    rec = _record(tmp_path, 3)
    _ready(rec, 0, "10.0.0.1:30000")
    _ready(rec, 1, "10.0.0.2:30001")
    entries = [_entry("10.0.0.2:30001"), _entry("10.0.0.1:30000")]
    rows, shown = cls(home=tmp_path)._replica_rows(rec, entries, {2: (137, None)}, {}, {})
    assert [r.addr for r in rows] == ["10.0.0.1:30000", "10.0.0.2:30001", "server-2"]
    assert rows[2].exit_code == 137 and shown == 3
    assert rec.reason == "server-2 ended (killed by SIGKILL)"
