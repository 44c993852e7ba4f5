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

from areal_cli.schedulers.job_records import ClusterRecord, JobRecords


class SlurmRecord(ClusterRecord):
    __slots__ = ("slurm_state",)

    def __init__(self, *args, slurm_state: str = "PENDING", **fields):
        super().__init__(*args, **fields)
        self.slurm_state = slurm_state


_records = JobRecords("slurm", SlurmRecord)
root, path, write, read = _records.root, _records.path, _records.write, _records.read
load, all_records, trial_dir = _records.load, _records.all_records, _records.trial_dir
