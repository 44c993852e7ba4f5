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

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from areal_cli import settings
from areal_cli.errors import UsageError
from areal_cli.schedulers.api import LIVE


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


def root(home: Path) -> Path:
    return home / "ray" / settings.user()


def path(home: Path, experiment: str, trial: str, kind: str) -> Path:
    slot = "serve" if kind == "serve" else "train"
    return root(home) / experiment / trial / f"{slot}.json"


def write(home: Path, rec: RayRecord) -> None:
    rec.updated = time.time()
    p = path(home, rec.experiment, rec.trial, rec.kind)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(rec), indent=2))
        os.replace(tmp, p)
    except OSError as e:
        raise UsageError(
            f"cannot write the job record {p}: {e.strerror or e}",
            hint="pick a writable --home (or AREAL_HOME)",
        ) from None


def read(p: Path) -> RayRecord | None:
    try:
        return RayRecord(**json.loads(p.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def load(home: Path, experiment: str, trial: str, kind: str | None = None) -> list[RayRecord]:
    """The trial's records (of `kind` if given), live ones first."""
    kinds = [kind] if kind else ["serve", "train"]
    recs = [r for k in kinds if (r := read(path(home, experiment, trial, k))) is not None]
    recs.sort(key=lambda r: (not r.live, r.kind == "serve", -r.submitted))
    return recs


def all_records(home: Path) -> list[RayRecord]:
    """Every record of this user; an empty list, fast, when Ray was never used here."""
    base = root(home)
    if not base.is_dir():
        return []
    out = []
    for p in [*base.glob("*/*/serve.json"), *base.glob("*/*/train.json")]:
        rec = read(p)
        if rec is not None:
            out.append(rec)
    return sorted(out, key=lambda r: r.submitted, reverse=True)
