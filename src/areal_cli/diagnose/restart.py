"""Whether a training job that failed starts again (`areal train --max-restarts N`): the
doctor's root cause of the attempt that just died decides, never a guess.

    failure = restart.diagnose(log_dir)                 # what `areal doctor why` names
    d = restart.decide(failure, done, budget, "infra", previous)
    d.restart, d.line     # True, "restart 1/3: rank 1 killed by SIGKILL (signal): ..."

The rules, in order (the per-kind answer is a table: why_kinds' restart column):
- the budget is spent: stop;
- `--restart-on any`: restart;
- the same kind at the same place as the failure before the last restart: stop, it repeats
  (the place: the user's frame and message; without a frame, the rank, the message and the
  last line the rank logged);
- the kind's restart column (why_kinds.restart_verdict): an infrastructure fault (a signal,
  the OOM killer, a collective timeout, a lost connection, node or server) restarts; a
  Python exception in the job's code, a configuration error, an exhausted GPU stop.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from areal_cli import logfiles
from areal_cli.diagnose import why, why_kinds
from areal_cli.errors import ArealError
from areal_cli.files import private_dir

RESTART_ON = ("infra", "any")
ENV = "AREAL_RESTART"  # the restart a trainer runs in (1, 2, ...); absent in the first run
LOG = "restarts.jsonl"  # a cluster job's decisions, in its run folder (read by `areal ps`)


@dataclass
class Failure:
    kind: str | None  # the root cause's kind (why_kinds), None when the logs name none
    what: str  # the root cause in a few words: "rank 1 killed by SIGKILL"
    place: tuple  # what a repeat is compared by
    restart: bool  # the restart column's answer for it
    reason: str


@dataclass
class Decision:
    restart: bool
    line: str  # one line: the terminal, the job's log and `areal ps` show it
    attempt: int  # the restart it starts (1-based), or the restarts done when it refuses
    failure: Failure

    def to_json(self) -> dict:
        return {
            "restart": self.restart,
            "line": self.line,
            "attempt": self.attempt,
            "kind": self.failure.kind,
            "what": self.failure.what,
            "place": list(self.failure.place),  # the next decision compares with it
        }


def previous_failure(log: list[dict]) -> Failure | None:
    """The failure the last restart of a decision log followed (None before any restart)."""
    last = next((d for d in reversed(log) if d.get("restart")), None)
    if last is None:
        return None
    return Failure(last.get("kind"), last.get("what", ""), tuple(last.get("place") or ()),
                   True, "")  # fmt: skip


def read_log(run_dir: str | Path | None) -> list[dict]:
    """The decisions a cluster job's batch side wrote to its run folder (LOG), in order."""
    if not run_dir:
        return []
    try:
        text = (Path(run_dir) / LOG).read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a full disk
    return out


def append_log(run_dir: str | Path, decision: Decision) -> dict:
    entry = {**decision.to_json(), "time": time.time()}
    with open(Path(run_dir) / LOG, "a") as f:
        f.write(json.dumps(entry) + "\n")
    return entry


def archive_logs(log_dir: str | Path, attempt: int) -> None:
    """Move a failed attempt's rank, torchrun and watchdog logs to attempt-<n>/ of the log
    folder: the next attempt writes its own, and its failure is diagnosed from those alone."""
    log_dir = Path(log_dir)
    dest = None
    for label, path in logfiles.select_logs(log_dir).items():
        if not label.startswith(("rank-", "torchrun", "watchdog")):
            continue
        try:
            dest = dest or private_dir(log_dir / f"attempt-{attempt}")
            path.rename(dest / path.name)
        except (OSError, ArealError):
            pass  # left in place: the new run's log replaces it (logfiles.fresh_log)


def diagnose(log_dir: str | Path, torchrun_logs=(), exit_what: str = "") -> Failure:
    """The failure of the attempt that just ended, from its logs: the library call behind
    `areal doctor why`. `exit_what`: how the launcher ended, for when the logs name nothing."""
    _rank, _code, rep = why.first_failure(log_dir, torchrun_logs, kernel=why.read_kernel())
    return from_report(rep, log_dir, exit_what)


def from_report(rep, log_dir: str | Path, exit_what: str = "") -> Failure:
    root = rep.root
    if root is None:
        what = f"the trainers failed ({exit_what})" if exit_what else "the trainers failed"
        return Failure(None, what, (None, what), *why_kinds.restart_verdict(None))
    who = f"rank {root.rank} " if root.rank is not None else ""
    at = f" in {_short_where(root.where)}" if root.where else ""
    message = re.sub(r"\s*\(pid \d+\)", "", root.message)
    if who and message.startswith(who):
        who = ""  # "rank 1 killed by SIGKILL" names its rank already
    what = f"{who}{message}{at}"
    norm = re.sub(r"0x[0-9a-f]+|\d+", "N", message)  # pids, ports, addresses differ per run
    if root.where:
        place = (root.kind, root.where, norm)
    else:
        last = ""
        if root.rank is not None:
            tail = _last_line(Path(log_dir) / f"rank-{root.rank}.log")
            last = tail or ""
        place = (root.kind, root.rank, norm, last)
    return Failure(root.kind, what, place, *why_kinds.restart_verdict(
        root.kind, root.sender, root.exit_code))  # fmt: skip


def decide(
    failure: Failure, done: int, budget: int, restart_on: str, previous: Failure | None
) -> Decision:
    """Restart or stop after `done` restarts of `budget`; `previous`: the failure that the
    last restart followed (None before the first)."""
    kind = f" ({failure.kind})" if failure.kind else ""
    if done >= budget:
        return Decision(False, f"not restarting: the {_n(budget)} spent; last failure: "
                        f"{failure.what}{kind}", done, failure)  # fmt: skip
    n = done + 1
    if restart_on == "any":
        return Decision(True, f"restart {n}/{budget}: {failure.what}{kind} "
                        "(--restart-on any)", n, failure)  # fmt: skip
    if previous is not None and previous.kind is not None and previous.place == failure.place:
        return Decision(False, f"not restarting: {failure.what}{kind} again, at the same place "
                        f"as before restart {done}: it repeats", done, failure)  # fmt: skip
    if failure.restart:
        return Decision(True, f"restart {n}/{budget}: {failure.what}{kind}: {failure.reason}",
                        n, failure)  # fmt: skip
    return Decision(False, f"not restarting: {failure.what}{kind} would repeat: "
                    f"{failure.reason}", done, failure)  # fmt: skip


def _n(budget: int) -> str:
    return "1 restart is" if budget == 1 else f"{budget} restarts are"


def _short_where(where: str) -> str:
    path, _, line = where.rpartition(":")
    return f"{os.path.basename(path)}:{line}" if path else where


def _last_line(path: Path) -> str | None:
    lines = [x.strip() for x in logfiles.tail(path, 5) if x.strip()]
    return lines[-1] if lines else None
