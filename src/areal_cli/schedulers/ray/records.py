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

from areal_cli.schedulers.job_records import ClusterRecord, JobRecords


@dataclass
class RayRecord(ClusterRecord):
    address: str = ""
    actors: list[str] = field(default_factory=list)  # their names, namespace areal
    group: str | None = None  # the training nodes' placement group
    node_ids: dict[str, str] = field(default_factory=dict)  # label -> Ray node id


_records = JobRecords("ray", RayRecord)
root, path, write, read = _records.root, _records.path, _records.write, _records.read
load, all_records, trial_dir = _records.load, _records.all_records, _records.trial_dir
