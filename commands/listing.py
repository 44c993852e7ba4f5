"""`areal ps` itself, without typer: `areal ps [--all] [--json]` runs it straight from
areal_cli.cli (scripts poll it; typer alone costs about 50 ms of start-up), read with the
option table below, and the typer command (commands/jobs.py), built from the same table,
calls it with the same arguments."""

from __future__ import annotations

import time
from pathlib import Path

from areal_cli import console, schedulers, settings
from areal_cli.commands import Opt
from areal_cli.errors import WaitTimeout

# The options of `areal ps` that its plain form takes (--home and --registry: typer's only).
OPTIONS = [
    Opt("all_", "--all", kind=bool, default=False, help="Include jobs that have ended."),
    Opt("json_out", "--json", kind=bool, default=False, help="Machine-readable output on stdout."),
]


def plain(all_: bool, json_out: bool) -> int:
    show(all_, None, json_out)
    return 0


def show(all_: bool, home: Path | None, json_out: bool) -> None:
    jobs_, unanswered = [], []
    for sched in schedulers.used(settings.home(home)):
        try:
            jobs_ += [j.to_json() for j in sched.list(include_ended=all_)]
        except WaitTimeout as e:
            # One scheduler's controller not answering hides none of the others' jobs; the
            # command still exits 3 after listing what it knows.
            unanswered.append(e)
    jobs_.sort(key=lambda j: j["started"], reverse=True)
    if json_out:
        console.print_json(jobs_)
    elif not jobs_ and not unanswered:
        console.out.print(
            "no jobs" + ("" if all_ else " running (areal ps --all shows ended ones)")
        )
    elif jobs_:
        _ps_table(jobs_)
    if unanswered:
        raise unanswered[0]


def _ps_table(jobs_: list[dict]) -> None:
    from rich.markup import escape
    from rich.table import Table

    # Readable at 80 columns and in a pipe (rich lays out 80 wide there): no borders, the age
    # under the state, sentences (why a job ended, a stall) under the table, and nothing cut
    # with "…". Short cells keep their width; only `where` (pids, nodes) wraps, at spaces;
    # a model path sits under its job: a hub id (org/name) whole, a long local path folded at
    # the width of the longest E/T (widening the column for it would squeeze the others).
    t = Table(box=None, header_style="bold", pad_edge=False)
    job_w = max(max(len(j["name"]), min(24, len(j.get("model") or ""))) for j in jobs_)
    t.add_column("job", overflow="fold", width=min(40, job_w))
    t.add_column("kind", no_wrap=True)
    t.add_column("state", no_wrap=True)
    pid_w = max((len(f"pids {p}") for j in jobs_ for p in j.get("pids") or ()), default=4)
    t.add_column("where", overflow="fold", min_width=pid_w)  # a pid is never cut in two
    t.add_column("servers", no_wrap=True)
    t.add_column("GPUs", overflow="fold")
    notes = []
    for j in jobs_:
        servers = "\n".join(
            (
                f"[red]✗ {s['addr']}[/]"
                if s.get("exit_code") is not None
                else f"[{'green' if s['healthy'] else 'red'}]{'●' if s['healthy'] else '○'}[/] "
                f"{s['addr']}"
            )
            + (" [yellow]paused[/]" if s.get("paused") else "")
            + (f" [yellow]restarts {s['restarts']}[/]" if s.get("restarts") else "")
            + _errors_mark(s.get("errors"))
            for s in j["servers"]
        )
        gpus_ = ",".join(str(g) for s in j["servers"] for g in s.get("gpus", [])) or "cpu"
        state_color = {"running": "green", "failed": "red", "dead": "red"}.get(j["state"], "yellow")
        state = f"[{state_color}]{j['state']}[/]\n[dim]{_age(j['started'])}[/]"
        if j.get("world_size"):
            state += f"\nranks {j.get('ranks_alive') or 0}/{j['world_size']}"
        if j.get("reason"):
            notes.append(f"[bold]{j['name']}[/] [dim]{escape(j['reason'])}[/]")
        if j.get("restarts"):  # the trainers' restarts, and the last decision's line
            done = sum(1 for r in j["restarts"] if r.get("restart"))
            state += f"\n[yellow]restarts {done}[/]"
            notes.append(f"[bold]{j['name']}[/] [yellow]{escape(j['restarts'][-1]['line'])}[/]")
        if j.get("watchdog"):  # the last stall: its verdict (the bundle is in `areal logs`)
            w = j["watchdog"]
            odd = f" ranks {','.join(map(str, w['odd_ranks']))}" if w.get("odd_ranks") else ""
            state += "\n[red]stalled[/]"
            notes.append(f"[bold]{j['name']}[/] [red]stalled: {escape(str(w.get('kind')))}{odd}[/]")
        if not j["job_id"]:  # processes of this host, no cluster job
            where = "pids " + " ".join(map(str, j["pids"]))
        else:
            where = f"{j['scheduler']} {j['job_id']}" + (
                f"\n{','.join(j['nodes'])}" if j["nodes"] else ""
            )
        name = j["name"] + (f"\n[dim]{escape(j['model'])}[/]" if j.get("model") else "")
        t.add_row(name, j["kind"], state, where, servers or "-", gpus_)
    console.out.print(t)
    for note in notes:
        console.out.print(note)


def _errors_mark(errors: dict | None) -> str:
    """A server's errors of the last minute, and on a line of its own the last one's text,
    cut short (`--json` has it whole)."""
    from rich.markup import escape

    from areal_cli import request_errors

    mark = request_errors.marker(errors)
    if not mark:
        return ""
    last = (errors or {}).get("last") or {}
    text = f"{last.get('status', '')} {last.get('message', '')}".strip()
    short = text if len(text) <= 40 else text[:39] + "…"
    return f" [red]{mark}[/]" + (f"\n  [dim]{escape(short)}[/]" if short else "")


def _age(started: float) -> str:
    s = int(time.time() - started)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
