"""`areal doctor why`: the first failure of a job that died, and what followed from it."""

from __future__ import annotations

import re
from pathlib import Path

import typer
from rich.markup import escape

from areal_cli import console, schedulers, settings
from areal_cli.diagnose import logread, why
from areal_cli.diagnose.hang_report import ranks_text
from areal_cli.diagnose.why_kinds import kinds_help
from areal_cli.errors import EXIT_FAILED, UsageError

from ._common import RegistryOpt


def register(app: typer.Typer) -> None:
    app.command("why")(why_cmd)


def why_cmd(
    targets: list[str] = typer.Argument(
        None,
        metavar="E/T | FILE",
        help="A job that ended, or log files with --log.",
    ),
    log: bool = typer.Option(
        False, "--log", "-l", help="The arguments are log files (torchrun, AReaL, Slurm output)."
    ),
    kind: str = typer.Option(None, "--kind", help="serve | train (default: the training job)."),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    home: str = typer.Option(None, "--home", help="AREAL_HOME holding job records."),
    registry: str = RegistryOpt,
) -> None:
    """Name the first failure of a job that died and its kind; label what followed from it.

    Peers of a rank that died fail too (collective timeouts, closed connections,
    torchrun's ChildFailedError, AReaL's JobException): those are listed as secondary,
    each saying which failure caused it.

    Each kind carries advice for what to do next: restart (it may pass), stop (it would
    repeat) or unknown, with the reason. Kinds, their advice:

    {KINDS}

    --json prints {root_cause: {rank, source, kind, message, where, advice, ...}, advice:
    {action, reason}, secondary: [...], sources}; where the rank that failed first cannot be
    told, root_cause has no rank but "unsure" and "candidates".

    Each log is read whole, however long: a failure followed by gigabytes of
    other lines is found. Only regular files are logs (not a FIFO or a device).

    Exit code: 0 root cause named · 1 no failure found · 2 bad target.

    \b
    Examples:
      areal doctor why myexp/trial0            # a job that ended (areal ps --all)
      areal doctor why myexp/trial0 --json
      areal doctor why --log torchrun.log      # a log from anywhere
      areal doctor why --log slurm-4711.out rank-*.log
    """
    targets = list(targets or [])
    if not targets:
        raise UsageError(
            "give a job EXPERIMENT/TRIAL, or --log FILE...",
            hint="areal doctor why myexp/trial0  ·  areal doctor why --log torchrun.log",
        )
    kernel = why.read_kernel()
    if log:
        paths = []
        for t in targets:
            bad = logread.not_a_log(t)  # before any open: a FIFO's would block
            if bad:
                raise UsageError(f"{bad}: {t}")
            p = Path(t)
            paths.append((p.name, p))
        rep = why.analyze(why.parse_files(paths), kernel)
        rep.sources = [str(p) for _, p in paths]
        name = None
    else:
        if len(targets) != 1:
            raise UsageError(
                "give one job EXPERIMENT/TRIAL",
                hint="log files go with --log: areal doctor why --log A B",
            )
        name = targets[0]
        rep = _why_job(name, kind, home, kernel)
    if json_out:
        console.print_json({"job": name, **rep.to_json()})
    else:
        _render_why(rep, name)
    if rep.root is None:
        raise typer.Exit(EXIT_FAILED)


def _kinds_help() -> str:
    # Indented as the docstring around it, so that help's dedent keeps the list's own.
    return "\b\n" + "\n".join("    " + line for line in kinds_help().splitlines())


# The kinds come from the table the verdict uses (diagnose/why_kinds.py), so help lists them all.
why_cmd.__doc__ = why_cmd.__doc__.replace("{KINDS}", _kinds_help())


def _why_job(name: str, kind: str | None, home: str | None, kernel):
    parts = name.split("/")
    if len(parts) != 2 or not all(parts):
        raise UsageError(f"not a job name: {name!r}", hint="EXPERIMENT/TRIAL, e.g. myexp/trial0")
    if kind not in (None, "serve", "train"):
        raise UsageError(f"unknown --kind {kind!r}", hint="serve or train")
    found = schedulers.known_jobs(*parts, home=settings.home(home))
    if kind == "serve":
        found = [(s, h) for s, h in found if h.kind == "serve"]
    elif kind == "train" or len(found) > 1:
        found = [(s, h) for s, h in found if h.kind != "serve"] or found
    if not found:
        raise UsageError(f"no job {name}", hint="`areal ps --all` lists the jobs this home knows")
    sched, handle = found[0]
    st = sched.describe(handle)
    if st is None or not st.log_dir:
        raise UsageError(f"job {name} has no log folder on record")
    if st.state in ("pending", "starting", "running", "stopping"):
        raise UsageError(
            f"job {name} is still {st.state}",
            hint=f"a job that hangs: areal doctor hang --job {name}",
        )
    servers = [(f"server-{i}", s.exit_code, s.addr) for i, s in enumerate(st.servers)]
    records = why.record_events(st.state, st.message, servers, killed_by=sched.killed_by)
    return why.diagnose_dir(st.log_dir, kind=handle.kind, records=records, kernel=kernel)


def _render_why(rep, name: str | None) -> None:
    out = console.out
    if rep.root is None:
        out.print(
            f"no failure found in {len(rep.sources)} log(s)" + (f" of {name}" if name else "")
        )
        return
    r = rep.root
    who = f"rank {r.rank}" if r.rank is not None else r.source
    out.print(f"[bold red]root cause:[/] {escape(who)} · [bold]{r.kind}[/]")
    out.print(f"  {escape(r.message)}")
    if r.where:
        out.print(f"  at [cyan]{escape(r.where)}[/]")
    src = (r.path or r.source) + (f":{r.line}" if r.line else "")
    also = [x for x in r.ranks if x != r.rank]
    out.print(
        f"  [dim]{escape(src)}"
        + (
            f"; the same on rank{'s' if len(also) > 1 else ''} {', '.join(map(str, also))}"
            if also
            else ""
        )
        + "[/]"
    )
    if r.sender:
        out.print(f"  sent by: {escape(r.sender)}")
    if r.hint:
        out.print(f"  [yellow]{escape(r.hint)}[/]")
    if rep.unsure:
        out.print(
            f"  unsure: {escape(rep.unsure)} (candidates: ranks {ranks_text(rep.candidates)})"
        )
    if rep.advice:
        out.print(
            f"[bold]advice:[/] [bold]{rep.advice['action']}[/] · {escape(rep.advice['reason'])}"
        )
    if rep.secondary:
        out.print(f"[bold]secondary[/] ({len(rep.secondary)}), each caused by the root cause:")
        # One row per failure, however many ranks show it (addresses and pids aside).
        rows: dict[tuple, list] = {}
        for e in rep.secondary:
            key = (e.kind, e.source if e.rank is None else None, re.sub(r"\d+", "N", e.message))
            rows.setdefault(key, []).append(e)
        shown = []
        for group in rows.values():
            ranks = sorted({e.rank for e in group if e.rank is not None})
            if ranks:
                who = f"rank{'s' if len(ranks) > 1 else ''} {ranks_text(ranks)}"
            else:
                who = group[0].source
            shown.append((who, group[0]))
        width = max(10, *(len(w) for w, _ in shown))
        for who, e in shown:
            msg = e.message if len(e.message) <= 110 else e.message[:109] + "…"
            same = (
                " (the same failure)" if e.caused_by and e.caused_by.startswith("the same") else ""
            )
            out.print(f"  {escape(who):<{width}} {e.kind:<19} {escape(msg)}{same}")
