"""`areal ps`, `areal logs`, `areal stop`: manage what runs, through job records."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from areal_cli import console, settings
from areal_cli.errors import UsageError

from ._common import COLORS, HomeOpt, JsonOpt, LinePrinter, RegistryOpt


def register(app: typer.Typer) -> None:
    app.command("ps", help=PS_HELP)(ps)
    app.command("logs", help=LOGS_HELP)(logs)
    app.command("stop", help=STOP_HELP)(stop)


PS_HELP = """List jobs: state, processes, servers and whether each answers /health.

\b
Examples:
  areal ps
  areal ps --all --json | jq '.[].servers'
"""


def ps(
    all_: bool = typer.Option(False, "--all", help="Include jobs that have ended."),
    home: Path = HomeOpt,
    json_out: bool = JsonOpt,
) -> None:
    from areal_cli import status

    jobs_ = status.job_statuses(settings.home(home), include_ended=all_)
    if json_out:
        console.print_json(jobs_)
        return
    if not jobs_:
        console.out.print(
            "no jobs" + ("" if all_ else " running (areal ps --all shows ended ones)")
        )
        return
    from rich.markup import escape
    from rich.table import Table

    t = Table()
    t.add_column("job", no_wrap=True)
    for col in ("kind", "state", "age", "pids", "servers", "GPUs"):
        t.add_column(col, no_wrap=col in ("kind", "state", "servers"))
    for j in jobs_:
        servers = "\n".join(
            f"[{'green' if s['healthy'] else 'red'}]{'●' if s['healthy'] else '○'}[/] {s['addr']}"
            for s in j["servers"]
        )
        gpus_ = ",".join(str(g) for s in j["servers"] for g in s.get("gpus", [])) or "cpu"
        state_color = {"running": "green", "failed": "red", "dead": "red"}.get(j["state"], "yellow")
        t.add_row(
            j["name"] + (f"\n[dim]{escape(j['model'])}[/]" if j.get("model") else ""), j["kind"], f"[{state_color}]{j['state']}[/]", _age(j["started"]),
            " ".join(map(str, j["pids"])), servers or "-", gpus_,
        )  # fmt: skip
    console.out.print(t)


LOGS_HELP = """Show a job's logs, merged with a \\[server-N] / \\[rank-N] prefix.

\b
Examples:
  areal logs default/trial0
  areal logs myexp/trial0 -f --role rank --index 1
  areal logs myexp/trial0 -n 200 --role server
"""


def logs(
    name: str = typer.Argument(..., help="Job as EXPERIMENT/TRIAL (see areal ps)."),
    follow: bool = typer.Option(
        False, "--follow", "-f", help="Keep printing new lines until the job ends."
    ),
    role: str = typer.Option(None, "--role", "-r", help="server | rank | torchrun | supervisor."),
    index: int = typer.Option(
        None, "--index", "-i", min=0, help="Only process/rank N of that role."
    ),
    lines: int = typer.Option(50, "--lines", "-n", min=0, help="Lines of history per file."),
    home: Path = HomeOpt,
) -> None:
    from areal_cli import jobs
    from areal_cli.logfiles import select_logs

    home_dir = settings.home(home)
    rec = jobs.load(home_dir, *jobs.parse_name(name))
    files = select_logs(Path(rec.log_dir), role, index)
    if not files:
        raise UsageError(
            f"no log files for {rec.name}"
            + (f" with role {role}" if role else "")
            + f" in {rec.log_dir}",
            hint="roles: server, rank, torchrun, supervisor",
        )
    printer = LinePrinter(console.out)
    for label in files:
        printer.colors.setdefault(label, COLORS[len(printer.colors) % len(COLORS)])
    offsets: dict[str, int] = {}
    for label, path in files.items():
        text = path.read_bytes() if path.exists() else b""
        offsets[label] = len(text)
        for line in text.decode(errors="replace").splitlines()[-lines:] if lines else []:
            printer(label, line)
    if not follow:
        return
    try:
        while True:
            grew = False
            for label, path in select_logs(Path(rec.log_dir), role, index).items():
                printer.colors.setdefault(label, COLORS[len(printer.colors) % len(COLORS)])
                grew |= _print_new(path, label, offsets, printer)
            if not grew:
                live = [r for r in jobs.load_all(home_dir, rec.experiment, rec.trial) if r.alive()]
                if not live:
                    break
                time.sleep(0.2)
    except KeyboardInterrupt:
        return


def _print_new(path: Path, label: str, offsets: dict[str, int], printer) -> bool:
    try:
        size = path.stat().st_size
    except OSError:
        return False
    start = offsets.get(label, 0)
    if size <= start:
        return False
    with path.open("rb") as f:
        f.seek(start)
        chunk = f.read(size - start)
    # Print whole lines only; keep a partial last line for the next round.
    end = chunk.rfind(b"\n") + 1
    if end == 0:
        return False
    offsets[label] = start + end
    for line in chunk[:end].decode(errors="replace").splitlines():
        printer(label, line)
    return True


STOP_HELP = """Stop a trial's jobs, every process they started and their registry entries.

Both the serve and the train job of the trial, or the one --kind names; grandchildren of
their processes go too.

\b
Examples:
  areal stop default/trial0
  areal stop myexp/trial0 --kind serve
  areal stop --all
"""


def stop(
    name: str = typer.Argument(None, help="Job as EXPERIMENT/TRIAL (see areal ps)."),
    all_: bool = typer.Option(False, "--all", help="Stop every running job of this user."),
    kind: str = typer.Option(None, "--kind", help="serve | train: only that job of the trial."),
    timeout: float = typer.Option(
        30.0, "--timeout", min=0.1, help="Seconds to wait for a clean stop."
    ),
    home: Path = HomeOpt,
    registry: str = RegistryOpt,
    json_out: bool = JsonOpt,
) -> None:
    from areal_cli import jobs, status

    home_dir = settings.home(home)
    if all_ == bool(name):
        raise UsageError(
            "give a job name or --all", hint="areal stop default/trial0 (see areal ps)"
        )
    if all_:
        here = settings.hostname()
        records = [r for r in jobs.list_all(home_dir)[0] if r.state in jobs.LIVE and r.host == here]
    else:
        exp, trial = jobs.parse_name(name)
        if kind is not None and kind not in ("serve", "train"):
            raise UsageError(f"--kind {kind!r}: choose serve or train")
        records = (
            [jobs.load(home_dir, exp, trial, kind)] if kind else jobs.load_all(home_dir, exp, trial)
        )
        if not records:
            jobs.load(home_dir, exp, trial)  # raises the "no job" error with its hint
        live = [r for r in records if r.alive() and r.state in jobs.LIVE]
        # Nothing runs: still sweep the newest job's leftovers (processes, registry entries).
        records = live or records[:1]
    results = []
    for rec in records:
        with console.err.status(f"stopping {rec.name} ..."):
            results.append(status.stop_job(home_dir, rec, timeout, settings.registry_url(registry)))
    if json_out:
        console.print_json(results)
        return
    if not results:
        console.out.print("nothing to stop")
    for r in results:
        verb = "stopped" if r["was_running"] else "was not running; cleaned up"
        console.out.print(f"[green]{r['name']}[/] {verb} ({r['killed']} leftover process(es) killed, "
                          f"{r['deregistered']} registry entries removed)")  # fmt: skip


def _age(started: float) -> str:
    s = int(time.time() - started)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
