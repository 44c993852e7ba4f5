"""Records of jobs started on a Ray cluster, kept in AREAL_HOME beside the other schedulers'
(never mixed with them):

    <home>/ray/<user>/<experiment>/<trial>/serve.json     the trial's latest serving job
    <home>/ray/<user>/<experiment>/<trial>/train.json     its latest training job
    <home>/ray/<user>/<experiment>/<trial>/<slot>-<id>/   that start: the plan (private), the
                                                          runners' exit codes and output

Ray forgets a dead actor's story once the cluster restarts, so the record keeps the last
state seen and the outcome.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_cli.schedulers.api import LIVE
from areal_cli.schedulers.job_records import JobRecords


@dataclass
class RayRecord:
    experiment: str
    trial: str
    kind: str
    job_id: str
    marker: str
    state: str  # our words (schedulers.api LIVE / ENDED)
    submitted: float
    log_dir: str
    registry: str
    run_dir: str
    address: str = ""
    actors: list[str] = field(default_factory=list)  # their names, namespace areal
    group: str | None = None  # the training nodes' placement group
    node_ids: dict[str, str] = field(default_factory=dict)  # label -> Ray node id
    alloc: str | None = None
    model: str | None = None
    replicas: int = 0
    world_size: int = 0
    nodes: list[str] = field(default_factory=list)
    reason: str | None = None
    api_key_file: str | None = None
    message: str | None = None
    detail: str | None = None
    exit_code: int | None = None
    started: float | None = None
    updated: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.experiment}/{self.trial}"

    @property
    def live(self) -> bool:
        return self.state in LIVE


_records = JobRecords("ray", RayRecord)
root, path, write, read = _records.root, _records.path, _records.write, _records.read
load, all_records = _records.load, _records.all_records
