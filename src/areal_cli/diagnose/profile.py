"""`areal doctor profile`: `py-spy record` on every rank at once, and where each rank's time goes.

One py-spy per process, all started together for the same duration, each writing a speedscope
file (`--format speedscope`, idle threads included: a rank waiting for its peers in a
collective sleeps in the kernel, and that wait is what tells the ranks apart). From each file:

- a flame graph (SVG) of the rank's main thread, drawn here from the same samples (py-spy
  writes one format per recording, and a second recording could not attach at the same time);
- the rank's top functions (by samples on top of the stack, and inclusive);
- its share of samples inside a collective (the frames the hang doctor knows as collectives,
  areal_cli.diagnose.collectives), and the mean time it computes between two collectives.

The rank that computes longest between collectives, clearly longer than the others while they
wait in collectives, is named the straggler: the others wait for it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from html import escape
from pathlib import Path

from areal_cli import procs, settings
from areal_cli.diagnose import collectives, remote_call, stacks
from areal_cli.diagnose.targets import Job
from areal_cli.errors import UsageError
from areal_cli.registry import open_registry

STRAGGLER_RATIO = 1.5  # compute between collectives vs the median of the other ranks
MIN_WAIT_SHARE = 0.2  # the others must spend this much in collectives


@dataclass
class RankProfile:
    rank: int | None
    pid: int
    role: str = "rank"  # rank | server
    samples: int = 0
    collective_share: float = 0.0
    compute_between_s: float = 0.0  # mean run of samples outside collectives, in seconds
    top_self: list[dict] = field(default_factory=list)
    top_total: list[dict] = field(default_factory=list)
    speedscope: str | None = None
    svg: str | None = None
    error: str | None = None
    node: str | None = None  # a rank of a cluster job: the node it runs on


@dataclass
class ProfileReport:
    job: str
    duration: float
    rate: int
    native: bool
    ranks: list[RankProfile]
    straggler: dict | None
    wall_s: float = 0.0
    # A cluster job: nodes_s until every node answered, node_s each node's own time.
    timing: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def record(
    job: Job,
    out_dir: str | Path,
    *,
    duration: float = 10.0,
    rate: int = 100,
    native: bool = False,
    servers: list[int] | None = None,
    on_progress: Callable[[float], None] | None = None,
) -> ProfileReport:
    t0 = time.monotonic()
    out = Path(out_dir)
    output_dir(out)
    timing: dict = {}
    if job.on_other_nodes:
        targets, timing = _record_on_nodes(job, out, duration=duration, rate=rate,
                                           native=native, on_progress=on_progress)  # fmt: skip
    else:
        stacks.require_pyspy()
        targets = [
            RankProfile(r.rank if r.rank is not None else i, r.pid) for i, r in enumerate(job.ranks)
        ]
        targets += [RankProfile(i, pid, role="server") for i, pid in enumerate(servers or [])]
        paths = run_pyspy(targets, out, duration=duration, rate=rate, native=native,
                          on_progress=on_progress, t0=t0)  # fmt: skip
        for t, path in zip(targets, paths, strict=True):
            if t.error is None:
                finish(t, path, rate)
    ranks = [t for t in targets if t.role == "rank"]
    rep = ProfileReport(job.name or job.label, duration, rate, native, targets, straggler(ranks))
    rep.wall_s = round(time.monotonic() - t0, 3)
    rep.timing = timing
    (out / "summary.json").write_text(json.dumps(rep.to_json(), indent=1))
    return rep


def _stem(t: RankProfile) -> str:
    where = f"-{t.node}" if t.node else ""
    return f"rank{t.rank}{where}" if t.role == "rank" else f"server{t.rank}{where}"


def run_pyspy(
    targets: list[RankProfile],
    out: Path,
    *,
    duration: float,
    rate: int,
    native: bool,
    on_progress: Callable[[float], None] | None = None,
    t0: float | None = None,
) -> list[Path]:
    """One `py-spy record` per target, all at once, each writing its speedscope file under
    `out`; a target whose recording failed gets its `error`."""
    pyspy = stacks.require_pyspy()
    t0 = time.monotonic() if t0 is None else t0
    running: list[tuple[RankProfile, subprocess.Popen, Path]] = []
    for t in targets:
        path = out / f"{_stem(t)}.speedscope.json"
        argv = [pyspy, "record", "--pid", str(t.pid), "--duration", f"{duration:g}",
                "--rate", str(rate), "--format", "speedscope", "--output", str(path),
                "--idle", "--full-filenames", "--nolineno"]  # fmt: skip
        if native:
            argv.append("--native")
        proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env=stacks._pyspy_env(), start_new_session=True,
        )  # fmt: skip
        running.append((t, proc, path))
    try:
        deadline = time.monotonic() + duration + 15.0
        while any(p.poll() is None for _, p, _ in running):
            if on_progress is not None:
                on_progress(min(duration, time.monotonic() - t0))
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        for _t, p, _path in running:
            if p.poll() is None:
                # py-spy's own children too: a group of its own, ended whole.
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
            p.wait()
    for t, p, path in running:
        err = (p.stderr.read() if p.stderr else "") or ""
        if p.returncode != 0 or not path.exists():
            line = next((x for x in err.splitlines() if "rror" in x), err.strip()[-200:])
            t.error = line or f"py-spy exited with {p.returncode}"
    return [path for _, _, path in running]


def finish(t: RankProfile, path: Path, rate: int) -> None:
    """Read a target's speedscope file: its summary, and its flame graph beside it."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        t.error = f"unreadable speedscope file {path}: {e}"
        return
    t.speedscope = str(path)
    summarise(t, data, rate)
    svg = path.with_name(path.name.replace(".speedscope.json", ".svg"))
    where = f" on {t.node}" if t.node else ""
    title = f"{t.role} {t.rank} (pid {t.pid}{where})"
    svg.write_text(flamegraph_svg(*main_thread(data), title=title))
    t.svg = str(svg)


def _record_on_nodes(
    job: Job, out: Path, *, duration: float, rate: int, native: bool,
    on_progress: Callable[[float], None] | None,
) -> tuple[list[RankProfile], dict]:  # fmt: skip
    """A cluster job: py-spy on every node at once (diagnose.remote), its files brought back
    and written under `out` as rankN-NODE.*; a node that gives none is an error per rank."""
    import threading

    t0 = time.monotonic()
    start = time.time() + job.lead + 0.5  # every node starts recording at one moment
    argv = ["profile", "--duration", f"{duration:g}", "--rate", str(rate),
            "--start", f"{start:.3f}"] + (["--native"] if native else [])  # fmt: skip
    got: dict = {}
    worker = threading.Thread(
        target=lambda: got.update(remote_call.on_nodes(job, argv, timeout=duration + 60.0)),
        daemon=True,
    )
    worker.start()
    while worker.is_alive():
        if on_progress is not None:
            on_progress(min(duration, max(0.0, time.monotonic() - t0 - 1.0)))
        worker.join(0.1)
    reached_s = time.monotonic() - t0
    targets: list[RankProfile] = []
    known = {(r.node, r.pid): r for r in job.ranks}
    for node, (data, why) in got.items():
        seen = set()
        for r in (data or {}).get("ranks", []):
            t = RankProfile(r["rank"], r["pid"], node=node)
            seen.add((node, r["pid"]))
            answer = (data.get("profiles") or {}).get(str(r["pid"])) or {}
            if why or "speedscope" not in answer:
                t.error = answer.get("error") or why or "no profile came back"
            else:
                path = out / f"{_stem(t)}.speedscope.json"
                path.write_bytes(remote_call.unpack(answer["speedscope"]))
                finish(t, path, rate)
            targets.append(t)
        for (n, pid), r in known.items():
            if n == node and (n, pid) not in seen:
                targets.append(RankProfile(r.rank, pid, node=node,
                                           error=why or "the process exited"))  # fmt: skip
    timing = {"nodes_s": round(reached_s, 3),
              "node_s": {n: (d or {}).get("took_s") for n, (d, _w) in got.items()}}  # fmt: skip
    order = sorted(targets, key=lambda t: (t.rank if t.rank is not None else 1 << 30, t.pid))
    return order, timing


def output_dir(path: Path) -> Path:
    """Make the folder results go to, or say why it cannot be (exit 2, before any work)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UsageError(f"{path} exists and is not a folder") from None
    except OSError as e:
        raise UsageError(f"cannot make {path}: {e.strerror}") from None
    return path


def main_thread(data: dict) -> tuple[list[list[dict]], list[float]]:
    """The main thread's stacks (root first, as frame dicts) and their weights."""
    frames = data["shared"]["frames"]
    profiles = data.get("profiles") or []
    if not profiles:
        return [], []
    prof = next((p for p in profiles if '"MainThread"' in p.get("name", "")), None)
    if prof is None:
        prof = max(profiles, key=lambda p: len(p.get("samples", [])))
    stacks_ = [[frames[i] for i in s] for s in prof["samples"]]
    return stacks_, list(prof.get("weights") or [1.0] * len(stacks_))


def in_collective(stack: list[dict]) -> bool:
    for f in stack:
        name = f.get("name", "")
        if collectives.lookup(f.get("file") or "", name):
            return True
        if "::" in name and name.split("::")[0].lstrip("_") in ("c10d", "c10d_functional"):
            return True
    return False


def summarise(t: RankProfile, data: dict, rate: int, top: int = 8) -> None:
    stacks_, weights = main_thread(data)
    t.samples = len(stacks_)
    if not stacks_:
        return
    marks = [in_collective(s) for s in stacks_]
    total = sum(weights)
    t.collective_share = round(sum(w for w, m in zip(weights, marks, strict=True) if m) / total, 4)
    runs, cur = [], 0.0
    for w, m in zip(weights, marks, strict=True):
        if m:
            if cur:
                runs.append(cur)
            cur = 0.0
        else:
            cur += w
    if cur:
        runs.append(cur)
    t.compute_between_s = round(sum(runs) / len(runs), 4) if runs else 0.0
    own: Counter = Counter()
    incl: Counter = Counter()
    for s, w in zip(stacks_, weights, strict=True):
        if s:
            own[_label(s[-1])] += w
        for name in {_label(f) for f in s}:
            incl[name] += w
    t.top_self = [{"function": n, "share": round(v / total, 4)} for n, v in own.most_common(top)]
    t.top_total = [{"function": n, "share": round(v / total, 4)} for n, v in incl.most_common(top)]


def _label(f: dict) -> str:
    file = f.get("file") or ""
    short = "/".join(file.split("/")[-2:]) if file else ""
    return f"{f.get('name', '?')} ({short})" if short else f.get("name", "?")


def straggler(ranks: list[RankProfile]) -> dict | None:
    ok = [r for r in ranks if r.samples and r.error is None]
    if len(ok) < 2:
        return None
    slow = max(ok, key=lambda r: r.compute_between_s)
    others = sorted(r.compute_between_s for r in ok if r is not slow)
    median = others[len(others) // 2]
    waiting = [r for r in ok if r is not slow and r.collective_share >= MIN_WAIT_SHARE]
    if not waiting or slow.compute_between_s < STRAGGLER_RATIO * max(median, 1e-9):
        return None
    on = f" (on {slow.node})" if slow.node else ""
    return {
        "rank": slow.rank,
        "pid": slow.pid,
        "node": slow.node,
        "compute_between_s": slow.compute_between_s,
        "others_median_s": median,
        "ratio": round(slow.compute_between_s / max(median, 1e-9), 2),
        "summary": f"rank {slow.rank}{on} computes {slow.compute_between_s:.3f}s between "
        f"collectives, the others {median:.3f}s, and they wait for it "
        f"({min(r.collective_share for r in waiting):.0%}+ of their time in collectives)",
    }


def job_servers(job: Job) -> list[int]:
    """Pids of the inference servers on this host that the job's ranks were given
    (AREAL_LLM_SERVER_ADDRS), from the registry the ranks use. Empty when none is known, and
    for a cluster job, whose rank pids are their nodes' and mean nothing here."""
    if job.on_other_nodes:
        return []
    env: dict[str, str] = {}
    for r in job.ranks:
        try:
            raw = Path(f"/proc/{r.pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        env = dict(kv.decode(errors="replace").partition("=")[::2] for kv in raw if b"=" in kv)
        break
    addrs = {a.strip() for a in env.get("AREAL_LLM_SERVER_ADDRS", "").split(",") if a.strip()}
    if not addrs:
        return []
    try:
        listing = open_registry(env.get("AREAL_REGISTRY") or None).list()
    except Exception:  # a registry that does not answer: profile the ranks alone
        return []
    host = settings.hostname()
    return sorted(
        {e.pid for e in listing.servers
         if e.addr in addrs and e.pid and e.host in (None, host) and procs.pid_alive(e.pid)}
    )  # fmt: skip


# --------------------------------------------------------------------------- flame graph


def flamegraph_svg(stacks_: list[list[dict]], weights: list[float], title: str = "") -> str:
    """A static icicle-style flame graph (root at the bottom), one <rect> per call path with
    its function, share and sample count in a <title> tooltip."""
    root: dict = {"n": 0.0, "c": {}}
    for s, w in zip(stacks_, weights, strict=True):
        node = root
        node["n"] += w
        for f in s:
            node = node["c"].setdefault(_label(f), {"n": 0.0, "c": {}})
            node["n"] += w
    width, row, total = 1200.0, 16, root["n"] or 1.0
    rects: list[str] = []
    depth_max = [0]

    def walk(node: dict, x: float, depth: int) -> None:
        for name, child in sorted(node["c"].items()):
            w = child["n"] / total * width
            if w >= 0.5 and depth < 128:
                depth_max[0] = max(depth_max[0], depth)
                rects.append((name, child["n"], x, depth, w))  # type: ignore[arg-type]
                walk(child, x, depth + 1)
            x += w

    walk(root, 0.0, 0)
    height = (depth_max[0] + 2) * row + 30
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{int(width)}" height="{height}" '
        f'viewBox="0 0 {int(width)} {height}" font-family="monospace" font-size="11">',
        f'<text x="4" y="16">{escape(title)} · {int(root["n"] * 1000) / 1000}s sampled</text>',
    ]
    for name, n, x, depth, w in rects:  # type: ignore[misc]
        y = height - (depth + 1) * row
        hue = 10 + sum(name.encode()) % 40
        tip = f"{name}: {n / total:.1%} ({n:g}s)"
        chars = int(w / 7)
        label = escape(name[:chars]) if chars >= 3 else ""
        out.append(
            f'<g><title>{escape(tip)}</title><rect x="{x:.1f}" y="{y}" width="{w:.1f}" '
            f'height="{row - 1}" fill="hsl({hue},80%,60%)"/>'
            f'<text x="{x + 2:.1f}" y="{y + row - 4}">{label}</text></g>'
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"
