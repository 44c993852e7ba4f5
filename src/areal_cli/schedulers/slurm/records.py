"""Records of submitted Slurm jobs, kept in AREAL_HOME beside the local scheduler's (never mixed
with them):

    <home>/slurm/<user>/<experiment>/<trial>/serve.json     the trial's latest serving job
    <home>/slurm/<user>/<experiment>/<trial>/train.json     its latest training job
    <home>/slurm/<user>/<experiment>/<trial>/<slot>-<id>/   that submission: plan (private),
                                                            batch script, exit codes of steps

squeue forgets an ended job after a few minutes and there may be no accounting (sacct), so
the record keeps the last state seen and the outcome.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_cli.schedulers.api import LIVE
from areal_cli.schedulers.job_records import JobRecords


@dataclass
class SlurmRecord:
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
    slurm_state: str = "PENDING"
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


_records = JobRecords("slurm", SlurmRecord)
root, path, write, read = _records.root, _records.path, _records.write, _records.read
load, all_records = _records.load, _records.all_records
