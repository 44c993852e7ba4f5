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

from areal_cli.schedulers.job_records import ClusterRecord, JobRecords


class RayRecord(ClusterRecord):
    __slots__ = ("address", "actors", "group", "node_ids")

    def __init__(
        self,
        *args,
        address: str = "",
        actors: list[str] | None = None,  # their names, namespace areal
        group: str | None = None,  # the training nodes' placement group
        node_ids: dict[str, str] | None = None,  # label -> Ray node id
        **fields,
    ):
        super().__init__(*args, **fields)
        self.address, self.group = address, group
        self.actors = [] if actors is None else actors
        self.node_ids = {} if node_ids is None else node_ids


_records = JobRecords("ray", RayRecord)
root, path, write, read = _records.root, _records.path, _records.write, _records.read
load, all_records, trial_dir = _records.load, _records.all_records, _records.trial_dir
