"""torch's flight recorder, as the hang doctor reads it: each rank's ring of recent collectives
(process group, sequence number, op, sizes, dtypes, whether it completed), asked from the rank
over its doctor channel (areal_cli.worker.channel), so a rank blocked in C++ still answers.

Pure except `gather` (the channel) and `torch_analysis` (torch's own analyzer, in a
subprocess: the doctor never imports torch itself).

Measured on torch 2.13 with gloo: every entry's `state` reads "scheduled", even for a
collective that completed; `retired` is what tells (a completed collective is retired). NCCL
fills `state` (scheduled, started, completed). Gloo also records its `pg_config` before the
group's name and ranks are set (`{"": {"name": "", "ranks": "[]"}}`), which crashes torch's
analyzer with KeyError: ('0', 0); `torch_pg_config` rebuilds it from the groups the rank
itself reads from c10d.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from areal_cli import files
from areal_cli.diagnose import collectives
from areal_cli.diagnose.jsonfields import json_fields


@dataclass(frozen=True)
class Entry:
    pg: str  # the group's name as c10d gives it ("0" is the default group)
    desc: str  # its description ("default_pg", or what new_group(group_desc=) said)
    seq: int  # collective_seq_id (p2p_seq_id for send/recv): the group's count so far
    op: str  # "all_reduce", "broadcast", ... (profiling_name without "gloo:" / "nccl:")
    input_sizes: tuple = ()
    output_sizes: tuple = ()
    dtypes: tuple[str, ...] = ()
    state: str = "scheduled"  # completed | started | scheduled: as the rank sees it
    p2p: bool = False
    record_id: int = 0

    @property
    def pending(self) -> bool:
        return self.state != "completed"

    def to_json(self) -> dict:
        return json_fields(self, "pg desc seq op input_sizes output_sizes dtypes state")

    def label(self) -> str:
        sizes = ",".join("x".join(map(str, s)) or "scalar" for s in self.input_sizes)
        dt = ",".join(self.dtypes)
        return (
            f"collective #{self.seq} of group {self.desc or self.pg} ({self.op} "
            f"[{sizes}] {dt}, {self.state})"
        )


@dataclass
class RankFlight:
    """One rank's dump: its entries oldest first and its process groups (name -> ranks)."""

    rank: int
    pid: int | None
    entries: list[Entry] = field(default_factory=list)
    groups: dict[str, dict] = field(default_factory=dict)  # name -> {"desc", "ranks"}
    buffer_size: int = 0
    raw: dict | None = None  # the recorder's own JSON, for the bundle and torch's analyzer
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def pending(self) -> Entry | None:
        """The collective this rank waits in: its newest one not completed."""
        for e in reversed(self.entries):
            if e.pending:
                return e
        return None

    def last_per_group(self) -> dict[str, Entry]:
        out: dict[str, Entry] = {}
        for e in self.entries:
            out[e.pg] = e
        return out

    def reached(self) -> Entry | None:
        """Where it stands: the collective it waits in, else its last one."""
        return self.pending() or (self.entries[-1] if self.entries else None)

    def members(self, pg: str) -> list[int] | None:
        g = self.groups.get(pg)
        return list(g["ranks"]) if g and g.get("ranks") else None

    def to_json(self) -> dict:
        reached = self.reached()
        return {
            "rank": self.rank,
            "buffer_size": self.buffer_size,
            "entries": len(self.entries),
            "reached": reached.to_json() if reached else None,
            "groups": [
                {**e.to_json(), "ranks": self.members(e.pg)} for e in self.last_per_group().values()
            ],
            "error": self.error,
        }


def _op(name: str) -> str:
    base = name.split(":", 1)[-1]
    return base or name


def parse(answer: dict, rank: int | None = None, pid: int | None = None) -> RankFlight:
    """A rank's answer to the channel's `fr` request (its dump and its groups)."""
    dump = answer.get("dump") or {}
    groups = {str(k): v for k, v in (answer.get("groups") or {}).items()}
    entries = []
    for e in dump.get("entries", []):
        pg = e.get("process_group") or ["", ""]
        p2p = bool(e.get("is_p2p"))
        state = e.get("state", "scheduled")
        if e.get("retired") and state != "completed":
            state = "completed"  # gloo never sets the state: retired means it finished
        entries.append(
            Entry(
                pg=str(pg[0]),
                desc=str(pg[1]) if len(pg) > 1 else "",
                seq=int(e.get("p2p_seq_id") if p2p else e.get("collective_seq_id", 0)),
                op=_op(str(e.get("profiling_name", "?"))),
                input_sizes=tuple(tuple(s) for s in e.get("input_sizes", [])),
                output_sizes=tuple(tuple(s) for s in e.get("output_sizes", [])),
                dtypes=tuple(e.get("input_dtypes", [])),
                state=state,
                p2p=p2p,
                record_id=int(e.get("record_id", 0)),
            )
        )
    entries.sort(key=lambda x: x.record_id)
    for e in entries:  # c10d's table lacks a desc the entries carry, or the other way round
        g = groups.setdefault(e.pg, {"desc": e.desc, "ranks": []})
        if not g.get("desc"):
            g["desc"] = e.desc
    r = answer.get("rank")
    return RankFlight(
        rank=int(r) if r is not None else (rank if rank is not None else -1),
        pid=answer.get("pid", pid),
        entries=entries,
        groups=groups,
        buffer_size=int(answer.get("buffer_size") or 0),
        raw=dump,
    )


def gather(pids: list[int], timeout: float = 3.0) -> dict[int, RankFlight | str]:
    """pid -> its RankFlight, or why there is none (no channel, no answer). All at once."""
    out: dict[int, RankFlight | str] = {}
    for pid, got in ask_all(pids, timeout).items():
        try:
            out[pid] = got if isinstance(got, str) else parse(got, pid=pid)
        except (ValueError, TypeError, KeyError) as e:
            out[pid] = f"failed: the dump could not be read ({type(e).__name__}: {e})"
    return out


def ask_all(pids: list[int], timeout: float = 3.0) -> dict[int, dict | str]:
    """pid -> its rank's raw `fr` answer over its doctor channel, or why there is none (a
    str). All at once: on a node of a cluster job (diagnose.nodes), the answers go back
    raw and are parsed on the doctor's side."""
    from areal_cli.worker import channel

    out: dict[int, dict | str] = {}

    def one(pid: int) -> None:
        try:
            out[pid] = channel.ask(pid, "fr", timeout=timeout)
        except channel.ChannelError as e:
            out[pid] = f"{e.kind}: {e}"

    threads = [threading.Thread(target=one, args=(p,), daemon=True) for p in pids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 1.0)
    return dict(out)  # a copy: a rank that answers after the wait adds to `out` meanwhile


# --------------------------------------------------------------------------- rules' facts


# Collectives whose every rank passes the same sizes. Not gather, scatter or all_to_all: the
# root's list, or uneven splits, differ from the others' by design.
SAME_SIZES = frozenset({"all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce"})


def sizes_disagree(flights: list[RankFlight]) -> tuple[Entry, dict[int, Entry]] | None:
    """The earliest collective (group, number) whose ranks recorded the same op with
    different sizes, a rank still waiting in it: (one of them, rank -> its entry), or None."""
    by_key: dict[tuple[str, int], dict[int, Entry]] = {}
    for f in flights:
        for e in f.entries:
            if not e.p2p and collectives.kind_of(e.op) in SAME_SIZES:
                by_key.setdefault((e.pg, e.seq), {})[f.rank] = e
    found = []
    for (_pg, seq), per_rank in by_key.items():
        # One that every rank finished is history (gloo returned wrong data silently, as it
        # does for a broadcast whose sender's tensor is smaller): not what the job waits on.
        if len(per_rank) < 2 or not any(e.pending for e in per_rank.values()):
            continue
        ops = {e.op for e in per_rank.values()}
        sizes = {e.input_sizes for e in per_rank.values()}
        if len(ops) == 1 and len(sizes) > 1:
            first = min(per_rank.values(), key=lambda e: e.record_id)
            found.append((min(e.record_id for e in per_rank.values()), seq, first, per_rank))
    if not found:
        return None
    found.sort(key=lambda x: (x[1], x[0]))
    return found[0][2], found[0][3]


def ops_disagree(flights: list[RankFlight]) -> tuple[Entry, dict[int, Entry]] | None:
    """The earliest collective (group, number) that ranks recorded as different ops, a rank
    still waiting in it: (one of them, rank -> its entry), or None. Threads of one rank that
    issue collectives on one group in a rank-dependent order leave this, while the stacks of
    every rank look alike."""
    by_key: dict[tuple[str, int], dict[int, Entry]] = {}
    for f in flights:
        for e in f.entries:
            if not e.p2p:
                by_key.setdefault((e.pg, e.seq), {})[f.rank] = e
    found = [
        (seq, min(e.record_id for e in per_rank.values()), per_rank)
        for (_pg, seq), per_rank in by_key.items()
        if len(per_rank) > 1
        and any(e.pending for e in per_rank.values())
        and len({e.op for e in per_rank.values()}) > 1
    ]
    if not found:
        return None
    _seq, _rid, per_rank = min(found, key=lambda x: (x[0], x[1]))
    return min(per_rank.values(), key=lambda e: e.record_id), per_rank


def groups_disagree(flights: list[RankFlight]) -> dict[str, list[int]] | None:
    """Ranks waiting in different process groups where a member of one waits in another:
    group name -> the ranks waiting in it; None when nobody does."""
    waiting = {f.rank: p for f in flights if (p := f.pending()) is not None}
    pgs = {e.pg for e in waiting.values()}
    if len(pgs) < 2:
        return None
    members = {}
    for f in flights:
        for name, g in f.groups.items():
            if g.get("ranks"):
                members.setdefault(name, set(g["ranks"]))
    for pg in pgs:
        inside = members.get(pg)
        if inside is None:
            continue
        for r, e in waiting.items():
            if r in inside and e.pg != pg:
                by: dict[str, list[int]] = {}
                for rr, ee in sorted(waiting.items()):
                    by.setdefault(ee.pg, []).append(rr)
                return by
    return None


# --------------------------------------------------------------------------- torch's analyzer


def torch_pg_config(f: RankFlight) -> dict:
    """pg_config as torch's analyzer reads it, keyed by the group names the entries carry.

    ProcessGroupGloo records its config before c10d has named the group and set its ranks
    (torch 2.13: one `""` key, ranks "[]"), and the analyzer then looks up ('0', rank) and
    raises KeyError. The rank's own c10d table has the real names and ranks.
    """
    cfg = {}
    for name, g in f.groups.items():
        if g.get("ranks"):
            cfg[name] = {"name": name, "desc": g.get("desc", ""), "ranks": json.dumps(g["ranks"])}
    raw_cfg = (f.raw or {}).get("pg_config") or {}
    for name, g in raw_cfg.items():
        if name and name not in cfg and g.get("ranks") not in (None, "", "[]"):
            cfg[name] = g  # NCCL records it right
    return cfg


def write_torch_dumps(flights: list[RankFlight], out: Path) -> list[Path]:
    """One file per rank in the format `torchfrtrace DIR` reads (a pickle named
    fr_trace_<rank>), pg_config repaired. Private, as the bundle that holds them (files)."""
    out = files.private_dir(out)
    written = []
    for f in flights:
        if not f.ok or f.raw is None:
            continue
        d = dict(f.raw)
        d["pg_config"] = torch_pg_config(f)
        for e in d.get("entries", []):
            e.setdefault("frames", [])
        path = out / f"fr_trace_{f.rank}"
        import pickle  # for the bundle only: not on doctor hang's start-up

        files.write_private(path, pickle.dumps(d))
        written.append(path)
    return written


def torch_analysis(flights: list[RankFlight], python: str, workdir: Path,
                   timeout: float = 60.0) -> list[str]:  # fmt: skip
    """What torch's analyzer (torch.distributed.flight_recorder, `torchfrtrace`) says about
    the dumps: its lines naming a mismatch, or why it could not run."""
    dumps = write_torch_dumps(flights, workdir)
    if not dumps:
        return []
    argv = [python, "-m", "torch.distributed.flight_recorder.fr_trace", str(workdir),
            "--prefix", "fr_trace_", "--allow-incomplete-ranks"]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env,
                             stdin=subprocess.DEVNULL)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return [f"torch's analyzer did not run: {e}"]
    text = (res.stdout + "\n" + res.stderr).splitlines()
    keep = [ln.strip() for ln in text if ln.strip() and "tabulate" not in ln]
    if res.returncode != 0:
        tail = keep[-1] if keep else f"exit {res.returncode}"
        return [f"torch's analyzer failed: {tail}"]
    return keep[:40]


_FINDING = ("error msg:", "not all ranks joining", "missing ranks:", "collective sequence number")


def is_finding(line: str) -> bool:
    """A line of torch's analyzer that says what is wrong (not one of its field dumps)."""
    return line.lower().startswith(_FINDING)
