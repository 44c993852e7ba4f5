"""`areal doctor diverge | memory | profile`: ranks that disagree, memory, where the time goes.

Thin: parse flags, call areal_cli.diagnose, render. Registered on doctor's app by doctor.py.
"""

from __future__ import annotations

from pathlib import Path

import typer

from areal_cli import console

from ._common import RegistryOpt

PID_HELP = "A rank, or a launcher (torchrun, areal) whose workers to read. Repeatable."
JOB_HELP = "A job record EXPERIMENT/TRIAL (see `areal ps`)."


def _jobs(pid, job, home):
    from areal_cli.diagnose import targets
    from areal_cli.errors import UsageError

    if pid and job:
        raise UsageError("give --pid or --job, not both")
    return targets.resolve(pids=list(pid or []), job=job, home=home)


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def register(app: typer.Typer) -> None:
    app.command("diverge")(diverge_cmd)
    app.command("memory")(memory_cmd)
    app.command("profile")(profile_cmd)


# =========================================================================== diverge


def diverge_cmd(
    pid: list[int] = typer.Option(None, "--pid", "-p", help=PID_HELP),
    job: str = typer.Option(None, "--job", "-j", help=JOB_HELP),
    timeout: float = typer.Option(
        60.0, "--timeout", min=1.0, help="Seconds for it all: the ranks' answers and the step."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    home: str = typer.Option(None, "--home", help="AREAL_HOME holding job records (for --job)."),
    registry: str = RegistryOpt,
) -> None:
    """Ask a live job's ranks whether the tensors they should share agree.

    The ranks (on areal's worker runtime, reporting ctx.progress(step)) run
    areal_cli.worker.check_consistency at a step about a second ahead, all at the
    same step, on the model shard_model sharded (or areal_cli.worker.watch(model,
    optimizer) named): a DTensor must agree along each mesh dimension where it is
    Replicate, a plain tensor across the dp group. Checksums travel; a mismatch is
    confirmed on the tensor (largest absolute difference from the reference rank).

    Exit code: 0 all agree · 1 a mismatch · 2 bad target (ranks that watch no model,
    a stopped rank) · 3 the step never came.

    \b
    Examples:
      areal doctor diverge --job myexp/trial0
      areal doctor diverge --pid 12345 --json   # torchrun's pid
    """
    from areal_cli.diagnose import diverge
    from areal_cli.errors import EXIT_FAILED, ArealError

    jobs = _jobs(pid, job, home)
    results = []
    for j in jobs:
        status = None
        if not json_out and console.err.is_terminal:
            status = console.err.status(f"asking {len(j.ranks)} rank(s) of {j.label}...")
            status.start()
        try:
            results.append(diverge.run(j, timeout=timeout))
        finally:
            if status is not None:
                status.stop()
    if json_out:
        data = [r.to_json() for r in results]
        console.print_json(data[0] if len(data) == 1 else {"jobs": data})
    else:
        for r in results:
            _render_diverge(r)
    for r in results:
        if r.report.get("error"):
            raise ArealError(f"the ranks could not run the check: {r.report['error']}")
    if any(not r.report.get("ok") for r in results):
        raise typer.Exit(EXIT_FAILED)


def _render_diverge(r) -> None:
    from rich.markup import escape

    rep, out = r.report, console.out
    if rep.get("error"):
        return
    head = f"[bold]{escape(r.job)}[/] step {r.step}: {rep['checked']} comparisons"
    head += f", {rep['skipped']} sharded everywhere, {rep['seconds']:.3f}s"
    out.print(head)
    if rep["ok"]:
        out.print("[green]all ranks agree[/]")
        return
    odd = sorted({r for m in rep["mismatches"] for r in m["ranks"]})
    where = sorted({r.nodes[x] for x in odd if x in r.nodes})
    on = f" (node {', '.join(where)})" if where else ""
    out.print(f"[red]rank(s) {', '.join(map(str, odd))}{escape(on)} differ: "
              f"{len(rep['mismatches'])} mismatch(es)[/]")  # fmt: skip
    for m in rep["mismatches"]:
        diff = "unconfirmed" if m["max_abs_diff"] is None else f"max |diff| {m['max_abs_diff']:.3g}"
        on = sorted({r.nodes[x] for x in m["ranks"] if x in r.nodes})
        out.print(
            f"  {escape(m['name'])} ({m['kind']}, {list(m['shape'])}) along {m['dim']} "
            f"{m['group']}: rank(s) {m['ranks']} differ from rank {m['reference_rank']}, {diff}"
            + (f" (on {escape(', '.join(on))})" if on else "")
        )


# =========================================================================== memory


def memory_cmd(
    pid: list[int] = typer.Option(None, "--pid", "-p", help=PID_HELP),
    job: str = typer.Option(None, "--job", "-j", help=JOB_HELP),
    snapshot: Path = typer.Option(
        None,
        "--snapshot",
        help="Write each rank's memory snapshot here (CUDA: torch's, for "
        "pytorch.org/memory_viz; CPU: the RSS breakdown from smaps_rollup).",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    home: str = typer.Option(None, "--home", help="AREAL_HOME holding job records (for --job)."),
    registry: str = RegistryOpt,
) -> None:
    """Each rank's memory beside the host's and the cgroup's limits; the biggest rank named.

    Per rank: resident memory (RSS) and, for ranks on areal's worker runtime that use
    CUDA, torch's allocated / reserved / peak bytes. The cgroup's limit is where the
    kernel's OOM killer (or Slurm's step) ends the job.

    \b
    Examples:
      areal doctor memory --job myexp/trial0
      areal doctor memory --pid 12345 --json
      areal doctor memory --job myexp/trial0 --snapshot ./mem   # then open pytorch.org/memory_viz
    """
    from areal_cli.diagnose import memory

    reports = [memory.gather(j, snapshot) for j in _jobs(pid, job, home)]
    if json_out:
        data = [r.to_json() for r in reports]
        console.print_json(data[0] if len(data) == 1 else {"jobs": data})
        return
    for rep in reports:
        _render_memory(rep)


def _render_memory(rep) -> None:
    from rich.markup import escape
    from rich.table import Table

    out = console.out
    cuda = any(r.cuda for r in rep.ranks)
    t = Table(title=f"memory of {escape(rep.job)}", title_justify="left")
    on_nodes = bool(rep.nodes or rep.errors)
    for col in (
        ("rank", "pid")
        + (("node",) if on_nodes else ())
        + ("rss",)
        + (("allocated", "reserved", "peak", "device") if cuda else ())
    ):
        t.add_column(col, justify="right")
    for r in rep.ranks:
        row = [str(r.rank), str(r.pid)] + ([escape(r.node or "-")] if on_nodes else [])
        row += [_bytes(r.rss)]
        if cuda:
            c = r.cuda or {}
            row += [_bytes(c.get("allocated")), _bytes(c.get("reserved")),
                    _bytes(c.get("peak_allocated")), _bytes(c.get("total"))]  # fmt: skip
        t.add_row(*row)
    out.print(t)
    if rep.most:
        m = rep.most
        on = f" on {m['node']}" if m.get("node") else ""
        out.print(f"most: rank {m['rank']} (pid {m['pid']}{on}), {_bytes(m['bytes'])} "
                  f"{m['what']}")  # fmt: skip
    hosts = {n: v["host"] for n, v in rep.nodes.items()} if on_nodes else {None: rep.host}
    for node, h in hosts.items():
        if not h:
            continue
        name = f"node {escape(node)}" if node else "host"
        out.print(f"{name}: {_bytes(h['used'])} used of {_bytes(h['total'])}, "
                  f"{_bytes(h['available'])} available")  # fmt: skip
    for node, why in rep.errors.items():
        out.print(f"[red]node {escape(node)}: {escape(why)}[/]")
    for cg in rep.cgroups.values():
        lim = "no limit" if cg["limit"] is None else f"limit {_bytes(cg['limit'])}"
        if cg["limit"] is not None and cg["limit_at"] != cg["path"]:
            lim += f" (set at {escape(cg['limit_at'])})"
        on = f" on {escape(cg['node'])}" if cg.get("node") else ""
        out.print(f"cgroup {cg['version']} {escape(cg['path'])}{on}: {_bytes(cg['usage'])} used, "
                  f"{lim}" + (f", peak {_bytes(cg['peak'])}" if cg["peak"] else ""))  # fmt: skip
    if not cuda:
        out.print(
            "[dim]no rank uses CUDA: RSS only (--snapshot writes each rank's RSS breakdown)[/]"
        )
    for s in rep.snapshots:
        if s["kind"] == "error":
            out.print(f"[red]rank {s['rank']}: {escape(s['error'])}[/]")
        elif s.get("path"):
            out.print(f"rank {s['rank']}: {s['kind']} written to {escape(s['path'])}")


# =========================================================================== profile


def profile_cmd(
    pid: list[int] = typer.Option(None, "--pid", "-p", help=PID_HELP),
    job: str = typer.Option(None, "--job", "-j", help=JOB_HELP),
    duration: float = typer.Option(
        10.0, "--duration", "-d", min=0.5, max=3600, help="Seconds to record."
    ),
    out_dir: Path = typer.Option(
        ..., "--out", "-o", help="Folder for the flame graphs, speedscope files and summary."
    ),
    rate: int = typer.Option(100, "--rate", min=1, max=1000, help="Samples per second."),
    native: bool = typer.Option(False, "--native", help="Include C/C++ frames (py-spy --native)."),
    servers: bool = typer.Option(
        True, "--servers/--no-servers", help="Record the job's inference servers here too."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    home: str = typer.Option(None, "--home", help="AREAL_HOME holding job records (for --job)."),
    registry: str = RegistryOpt,
) -> None:
    """Record every rank with py-spy at once; name the rank the others wait for.

    Writes per rank: rankN.svg (flame graph of the main thread) and
    rankN.speedscope.json (open in speedscope.app), serverN.* for the job's
    inference servers on this host, and summary.json. The summary
    gives each rank's top functions, its share of time inside collectives, and the
    mean time it computes between two collectives; the rank that computes clearly
    longest while the others wait in collectives is named the straggler.

    Exit code: 0 recorded · 1 a process could not be recorded · 2 bad target.

    \b
    Examples:
      areal doctor profile --job myexp/trial0 --duration 10 --out ./prof
      areal doctor profile --pid 12345 -d 5 -o ./prof --json
      areal doctor profile --job myexp/trial0 -d 5 -o ./prof --native
    """
    from areal_cli.diagnose import profile

    jobs = _jobs(pid, job, home)
    progress = None
    if not json_out and console.err.is_terminal:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(
            TextColumn("recording {task.fields[n]} process(es)"),
            BarColumn(),
            TimeElapsedColumn(),
            console=console.err,
            transient=True,
        )
        progress.start()
    reports = []
    try:
        for i, j in enumerate(jobs):
            task = None
            if progress is not None:
                task = progress.add_task("rec", total=duration, n=len(j.ranks))

            def tick(elapsed: float, task=task) -> None:
                if progress is not None:
                    progress.update(task, completed=elapsed)

            where = out_dir / f"job{i}" if len(jobs) > 1 else out_dir
            reports.append(
                profile.record(
                    j,
                    where,
                    duration=duration,
                    rate=rate,
                    native=native,
                    on_progress=tick,
                    servers=profile.job_servers(j) if servers else [],
                )  # fmt: skip
            )
    finally:
        if progress is not None:
            progress.stop()
    if json_out:
        data = [r.to_json() for r in reports]
        console.print_json(data[0] if len(data) == 1 else {"jobs": data})
    else:
        for i, rep in enumerate(reports):
            _render_profile(rep, out_dir if len(jobs) == 1 else out_dir / f"job{i}")
    if any(r.error for rep in reports for r in rep.ranks):
        from areal_cli.errors import EXIT_FAILED

        raise typer.Exit(EXIT_FAILED)


def _render_profile(rep, where: Path) -> None:
    from rich.markup import escape
    from rich.table import Table

    out = console.out
    t = Table(title=f"profile of {escape(rep.job)}, {rep.duration:g}s at {rep.rate}/s",
              title_justify="left")  # fmt: skip
    on_nodes = any(r.node for r in rep.ranks)
    cols = ("rank", "pid") + (("node",) if on_nodes else ())
    for col in cols + ("samples", "in collectives", "compute between", "top function"):
        t.add_column(col, justify="left" if col == "top function" else "right")
    for r in rep.ranks:
        node = [escape(r.node or "-")] if on_nodes else []
        if r.error:
            t.add_row(str(r.rank), str(r.pid), *node, "-", "-", "-", f"[red]{escape(r.error)}[/]")
            continue
        top = r.top_self[0] if r.top_self else None
        t.add_row(
            f"{r.rank}" if r.role == "rank" else f"server {r.rank}",
            str(r.pid),
            *node,
            str(r.samples),
            f"{r.collective_share:.0%}",
            f"{r.compute_between_s:.3f}s",
            escape(f"{top['function'].split(' (')[0]} {top['share']:.0%}") if top else "",
        )
    out.print(t)
    if rep.straggler:
        out.print(f"[bold red]straggler: {escape(rep.straggler['summary'])}[/]")
    else:
        out.print("no straggler: the ranks compute about as long between collectives")
    names = "rankN-NODE.svg" if on_nodes else "rankN.svg"
    out.print(f"[dim]flame graphs ({names}), speedscope files and summary.json in {where}[/]")
