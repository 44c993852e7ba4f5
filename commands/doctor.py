"""`areal doctor`: diagnose distributed training (hangs, env presets, all_reduce, host, mesh).

Thin: parse flags, call areal_cli.diagnose, render. Heavy imports stay inside the commands.
"""

from __future__ import annotations

from pathlib import Path

import typer

from areal_cli import console
from areal_cli.commands.doctor_hang import STATE_STYLE, _ranks_text, render_hang  # noqa: F401
from areal_cli.diagnose import hang_rules

from ._common import RegistryOpt

app = typer.Typer(
    help="""Diagnose distributed training: hangs, debug env presets, all_reduce, host health, mesh.

\b
Examples:
  areal doctor hang --job myexp/trial0   # every rank's stack, odd rank named
  areal doctor why myexp/trial0          # a job that died: its first failure
  areal doctor env --preset nccl -- areal train ...
  areal doctor allreduce --nproc 8       # busbw per size, hang-checked
  areal doctor check                     # is this host ready?
  areal doctor mesh --alloc fsdp:d2t2    # which rank sits where
  areal doctor diverge --job myexp/trial0   # do the replicas agree?
  areal doctor memory --job myexp/trial0    # per rank, beside the limits
  areal doctor profile --job myexp/trial0 -o ./prof   # flame graphs, straggler
""",
    no_args_is_help=True,
)


# =========================================================================== hang


@app.command("hang")
def hang_cmd(
    pid: list[int] = typer.Option(
        None,
        "--pid",
        "-p",
        help="A rank, or a launcher (torchrun, areal) whose workers to dump. Repeatable.",
    ),
    job: str = typer.Option(
        None, "--job", "-j", help="A job record EXPERIMENT/TRIAL (see `areal ps`)."
    ),
    samples: int = typer.Option(
        3, "--samples", "-n", min=1, max=100, help="Dump rounds compared for movement."
    ),
    interval: float = typer.Option(
        0.5, "--interval", min=0.0, help="Seconds from one round's start to the next."
    ),
    native: bool = typer.Option(False, "--native", help="Include C/C++ frames (slower)."),
    show_locals: bool = typer.Option(
        False, "--locals", help="Include local variables of each frame."
    ),
    timeout: float = typer.Option(
        10.0, "--timeout", min=0.5, help="Seconds py-spy may take per process."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    out_dir: Path = typer.Option(
        None, "--out", help="Write raw per-rank dumps and summary.json here."
    ),
    home: str = typer.Option(None, "--home", help="AREAL_HOME holding job records (for --job)."),
    registry: str = RegistryOpt,
) -> None:
    """Dump every rank's Python stack at once, group identical stacks, name the odd rank.

    Without --pid or --job: every torchrun/areal job of this user on this host.

    Verdicts, in the order they are tried: {kinds}. Each carries advice (restart, stop or
    unknown, and why). A hang is called only when nothing moved across the samples (3 over
    about 1 s).

    --json prints {job, ranks, groups, verdict, samples, errors, timing}; with several
    jobs, the first that hangs is at the top level and all are under "jobs".

    Exit code: 0 a verdict was reached, a hang found included (the verdict says which; with
    --json, its "verdict" field) · 1 a rank could not be dumped · 2 bad target or usage.

    \b
    Examples:
      areal doctor hang --job myexp/trial0
      areal doctor hang --pid 12345      # torchrun's pid: its workers are found
      areal doctor hang --samples 5 --interval 1 --json
      areal doctor hang --job myexp/trial0 --native --out ./hang-report
    """
    from areal_cli.commands.doctor_hang import run

    rc = run(
        pid=list(pid or []),
        job=job,
        samples=samples,
        interval=interval,
        native=native,
        show_locals=show_locals,
        timeout=timeout,
        json_out=json_out,
        out_dir=out_dir,
        home=home,
        registry=registry,
    )
    if rc:
        raise typer.Exit(rc)


# The kinds are read from the verdict table itself, so a new row shows here without an edit
# (hang_rules imports nothing: the help does not pay for the judging code).
hang_cmd.__doc__ = (hang_cmd.__doc__ or "").replace("{kinds}", hang_rules.help_text())


# =========================================================================== env


@app.command(
    "env",
    context_settings={"allow_interspersed_args": False},
)
def env_cmd(
    cmd: list[str] = typer.Argument(
        None, help="Command to run under the preset (after --).", show_default=False
    ),
    preset: str = typer.Option(
        None, "--preset", "-P", help="hang | nccl | nccl-bisect | crash | compile | perf"
    ),
    shell: str = typer.Option(
        "bash", "--shell", help="Output format: bash | fish | json | dotenv."
    ),
    list_: bool = typer.Option(False, "--list", "-l", help="List the presets."),
    explain: bool = typer.Option(False, "--explain", help="Show each variable with its meaning."),
) -> None:
    """Debug environment presets: print them for your shell, or run a command under one.

    Warnings about combinations that do nothing or harm (dump-on-timeout without a buffer,
    transport switches left on, CUDA_LAUNCH_BLOCKING in a perf run) go to stderr, including
    ones caused by variables already in your environment.

    \b
    Examples:
      eval "$(areal doctor env --preset hang)"
      areal doctor env --preset nccl --shell fish | source
      areal doctor env --preset nccl -- areal train --alloc fsdp:d2 train.py
      areal doctor env --preset nccl-bisect --explain
      areal doctor env --list
    """
    from areal_cli.diagnose import presets
    from areal_cli.errors import UsageError

    if shell not in presets.SHELLS:
        raise UsageError(
            f"unknown --shell {shell!r}", hint="choose one of: " + ", ".join(presets.SHELLS)
        )
    if list_:
        _list_presets(presets, shell)
        return
    if not preset:
        raise UsageError(
            "--preset is required",
            hint="valid presets: " + ", ".join(presets.preset_names()) + " (see --list)",
        )
    p = presets.get_preset(preset)
    warnings = presets.check(preset)
    for w in warnings:
        origin = " (from your environment)" if w.source == "environment" else ""
        console.err.print(f"[yellow]warning:[/] {w.message}{origin}")
        console.err.print(f"  [dim]fix: {w.fix}[/]")
    if cmd:
        code = presets.run_with_preset(preset, list(cmd))
        raise typer.Exit(code)
    if explain:
        _explain(p, shell)
        return
    # Raw text: this is meant for eval, no rich markup or wrapping.
    typer.echo(presets.render(preset, shell), nl=False)


def _list_presets(presets, shell: str) -> None:
    from rich.table import Table

    items = [presets.get_preset(n) for n in presets.preset_names()]
    if shell == "json":
        console.print_json(
            [{"name": p.name, "description": p.description, "vars": p.env()} for p in items]
        )
        return
    # Two columns, the variables under the description: a third column squeezed the text to
    # a word per line at 80 columns (and in a pipe, which rich lays out 80 wide).
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    table.add_column("preset", style="bold cyan", no_wrap=True)
    table.add_column("what it is for · variables")
    for p in items:
        names = " ".join(v.name for v in p.vars)
        table.add_row(p.name, f"{p.description}\n[dim]{names}[/]")
    console.out.print(table)


def _explain(p, shell: str) -> None:
    from rich.table import Table

    if shell == "json":
        console.print_json(
            {
                "name": p.name,
                "description": p.description,
                "vars": [{"name": v.name, "value": v.value, "meaning": v.meaning} for v in p.vars],
            }
        )
        return
    from rich.markup import escape

    console.out.print(f"[bold]{p.name}[/]: {p.description}")
    wide = max(len(v.name) for v in p.vars) + max(len(v.value) for v in p.vars) + 4
    if console.out.width - wide < MEANING_MIN:
        # Too narrow for three columns (80 wide, a pipe): each variable, its meaning under it.
        for v in p.vars:
            console.out.print(f"[cyan]{v.name}[/]=[bold]{escape(v.value)}[/]")
            console.out.print(f"    {escape(v.meaning)}")
        return
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    table.add_column("variable", style="cyan", no_wrap=True)
    table.add_column("value", style="bold", no_wrap=True)
    table.add_column("meaning")
    for v in p.vars:
        table.add_row(v.name, v.value, v.meaning)
    console.out.print(table)


MEANING_MIN = 40  # a meaning column narrower than this reads a word or two per line


# =========================================================================== allreduce


@app.command("allreduce")
def allreduce_cmd(
    nproc: int = typer.Option(
        None, "--nproc", min=1, help="Ranks (default: GPUs here, or 2 on CPU)."
    ),
    backend: str = typer.Option(
        None, "--backend", help="nccl | gloo (default: nccl with GPUs, else gloo)."
    ),
    sizes: str = typer.Option(
        None, "--sizes", help="MIN:MAX bytes, doubling (default 1K:256M nccl, 1K:16M gloo)."
    ),
    iters: int = typer.Option(20, "--iters", min=1, help="Timed all_reduce calls per size."),
    warmup: int = typer.Option(5, "--warmup", min=0, help="Untimed calls per size first."),
    timeout: float = typer.Option(
        120.0, "--timeout", min=1.0, help="Seconds before the run counts as hung."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the results as JSON."),
    print_script: bool = typer.Option(
        False, "--print-script", help="Print the standalone repro script and exit."
    ),
) -> None:
    """Minimal all_reduce repro under torchrun: time, algbw, busbw and a correctness check per size.

    busbw = algbw · 2(n−1)/n, as nccl-tests reports it. When the run exceeds --timeout, the
    hang doctor dumps the repro's ranks, prints its verdict, and the repro is torn down.

    \b
    Examples:
      areal doctor allreduce --nproc 8
      areal doctor allreduce --backend gloo --nproc 2 --sizes 1K:16M
      areal doctor env --preset nccl -- areal doctor allreduce --nproc 8
      areal doctor allreduce --print-script > repro.py   # for a bug report
    """
    import os

    from areal_cli.diagnose import allreduce

    if print_script:
        typer.echo(allreduce.script_text(), nl=False)
        return
    backend = backend or allreduce.default_backend()
    nproc = nproc or allreduce.default_nproc(backend)
    sizes = sizes or allreduce.DEFAULT_SIZES.get(backend, "1K:16M")
    force_hang = os.environ.get(allreduce.FORCE_HANG_ENV) == "1"

    table = None
    live = None
    if not json_out:
        console.out.print(
            f"[bold]all_reduce[/] · backend {backend} · {nproc} ranks · sizes {sizes} · "
            f"iters {iters} · warmup {warmup} · timeout {timeout:g}s"
        )
        table = _allreduce_table()
        if console.out.is_terminal:
            from rich.live import Live

            live = Live(table, console=console.out, refresh_per_second=8)
            live.start()

    def on_row(row) -> None:
        if table is not None:
            _add_row(table, row)

    def on_hang() -> None:
        if live is not None:
            live.stop()
        console.err.print(f"[red]no progress within {timeout:g}s: dumping the repro's ranks[/]")

    try:
        result = allreduce.run(
            nproc=nproc,
            backend=backend,
            sizes=sizes,
            iters=iters,
            warmup=warmup,
            timeout=timeout,
            force_hang=force_hang,
            on_row=on_row,
            on_hang=on_hang,
        )
    finally:
        if live is not None and live.is_started:
            live.stop()
    if json_out:
        console.print_json(result.to_json())
    else:
        if live is None and table is not None:
            console.out.print(table)
        if result.rows:
            console.out.print(
                f"[bold]avg busbw[/] {result.avg_busbw:.3f} GB/s · #wrong {result.wrong}"
            )
        if result.timed_out:
            if result.hang_reports:
                from areal_cli.diagnose import hang

                render_hang(hang.primary(result.hang_reports))
            elif result.hang_error:
                console.err.print(f"[red]hang diagnosis failed:[/] {result.hang_error}")
    if result.timed_out:
        console.err.print(
            f"[bold red]error:[/] the all_reduce repro did not finish within {timeout:g}s; "
            "it was torn down"
        )
        raise typer.Exit(3)
    if result.wrong:
        console.err.print(
            f"[bold red]error:[/] {result.wrong} wrong element(s): the all_reduce result is corrupt"
        )
        raise typer.Exit(1)


def _allreduce_table():
    from rich.table import Table

    t = Table(box=None, header_style="bold", pad_edge=False)
    # Two-line headers as nccl-tests prints them: the table fits 80 columns.
    for name, just in (
        ("size\n(B)", "right"),
        ("count\n(elements)", "right"),
        ("type", "right"),
        ("redop", "right"),
        ("time\n(us)", "right"),
        ("algbw\n(GB/s)", "right"),
        ("busbw\n(GB/s)", "right"),
        ("#wrong", "right"),
    ):
        t.add_column(name, justify=just, no_wrap=True)
    return t


def _add_row(t, row) -> None:
    wrong = f"[bold red]{row.wrong}[/]" if row.wrong else "0"
    t.add_row(
        str(row.size),
        str(row.count),
        row.type,
        row.redop,
        f"{row.time_us:.1f}",
        f"{row.algbw_gbps:.3f}",
        f"{row.busbw_gbps:.3f}",
        wrong,
    )


# =========================================================================== check


@app.command("check")
def check_cmd(
    json_out: bool = typer.Option(False, "--json", help="Print the rows as JSON."),
    home: str = typer.Option(None, "--home", help="AREAL_HOME holding job records."),
    registry: str = RegistryOpt,
    scheduler: str = typer.Option(
        None,
        "--scheduler",
        help="Also the scheduler's own rows: slurm (version, partitions, shared files), ray "
        "(client and cluster, nodes, shared files).",
    ),
    python: str = typer.Option(
        None,
        "--python",
        help="The trainer's interpreter: AReaL's version there, the sglang metadata its "
        "trainer needs, and served SGLang versions against AReaL's pin.",
    ),
) -> None:
    """Is this host ready to run and debug jobs? One row per fact, with the fix.

    Python, torch, CUDA, NCCL, GPUs, sglang/vllm/transformers, py-spy attach, /dev/shm, open
    files, the registry, registered servers, processes left from earlier jobs. Each row passes, warns or fails with the fix to apply; exit code 1 when any row fails.
    With --scheduler slurm: Slurm's version, each partition's GPUs per node, and whether the
    nodes see the registry and log folders.

    \b
    Examples:
      areal doctor check
      areal doctor check --scheduler slurm
      areal doctor check --python ~/areal-venv/bin/python   # AReaL's trainer venv
      areal doctor check --json | jq '.rows[] | select(.status != "pass")'
    """
    from areal_cli import schedulers
    from areal_cli.diagnose import check

    scheduler = schedulers.pick(scheduler) if scheduler else None
    if not json_out and console.err.is_terminal:
        with console.err.status("checking this host..."):
            rows = check.run_checks(
                home=home, registry=registry, scheduler=scheduler, python=python
            )
    else:
        rows = check.run_checks(home=home, registry=registry, scheduler=scheduler, python=python)
    failed = [r for r in rows if r.status == check.FAIL]
    if json_out:
        console.print_json(
            {
                "rows": [r.to_json() for r in rows],
                "ok": not failed,
                "counts": {
                    s: sum(r.status == s for r in rows)
                    for s in (check.PASS, check.WARN, check.FAIL)
                },
            }
        )
    else:
        from rich.markup import escape
        from rich.table import Table

        t = Table(box=None, header_style="bold", pad_edge=False)
        t.add_column("", no_wrap=True)
        t.add_column("check", style="bold", no_wrap=True)
        t.add_column("result", overflow="fold")
        t.add_column("fix", style="yellow", overflow="fold")
        mark = {
            check.PASS: "[green]✓ pass[/]",
            check.WARN: "[yellow]! warn[/]",
            check.FAIL: "[red]✗ fail[/]",
        }
        for r in rows:
            t.add_row(mark[r.status], r.name, escape(r.detail), escape(r.fix or ""))
        console.out.print(t)
    if failed:
        raise typer.Exit(1)


# =========================================================================== mesh


@app.command("mesh")
def mesh_cmd(
    alloc: str = typer.Option(
        ..., "--alloc", "-a", help="Allocation, e.g. fsdp:d2t2 or sglang:d2+fsdp:d2c2t2."
    ),
    name: str = typer.Option(None, "--name", help="Component to draw (default: the training one)."),
    json_out: bool = typer.Option(False, "--json", help="Print coordinates and groups as JSON."),
) -> None:
    """Every rank's coordinate per mesh dimension and the ranks of each process group.

    Exactly the mesh the workers build (areal_cli.worker.connect). Order, outermost to
    innermost: pp, dp, cp, tp, as torchtitan builds its DeviceMesh; dp is always there,
    the others when larger than 1. Tensor-parallel groups are consecutive ranks, so they
    stay on one node. FSDP shards over dp, or dp_cp (dp and cp flattened) when c > 1.

    \b
    Examples:
      areal doctor mesh --alloc fsdp:d2t2
      areal doctor mesh --alloc sglang:d4+fsdp:d2c2t2 --json
    """
    from areal_cli.diagnose import mesh

    m = mesh.from_alloc(alloc, name)
    if json_out:
        console.print_json(m.to_json())
        return
    from rich.table import Table

    from areal_cli.parallel import ORDER

    dims = m.names
    # A dimension of size 1 is no dimension of the workers' DeviceMesh: say so, rather than
    # leave the reader looking for its column.
    flat = [f"{d}=1" for d in ORDER if d not in dims]
    console.out.print(
        f"[bold]{m.component}[/] · world size {m.world_size} · "
        + " × ".join(f"{d}={s}" for d, s in m.dims.mesh_dims)
        + " · order outermost→innermost: "
        + ", ".join(dims)
        + (f" · {', '.join(flat)}: size 1, not in the mesh" if flat else "")
    )
    t = Table(box=None, header_style="bold", pad_edge=False)
    t.add_column("rank", justify="right", style="bold")
    for d in dims:
        t.add_column(d, justify="right")
    for g in m.groups:
        t.add_column(f"{g} group")
    for r in m.ranks:
        t.add_row(
            str(r["rank"]),
            *(str(r["coords"][d]) for d in dims),
            *(" ".join(map(str, r["groups"][g])) for g in m.groups),
        )
    console.out.print(t)
    for g, members in m.groups.items():
        console.out.print(
            f"[cyan]{g}[/] groups: " + "  ".join("[" + " ".join(map(str, b)) + "]" for b in members)
        )
    for n in m.notes:
        console.out.print(f"[dim]note: {n}[/]")


# =========================================================================== why


@app.command("why")
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
    from areal_cli.diagnose import logread, why
    from areal_cli.errors import EXIT_FAILED, UsageError

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
    from areal_cli.diagnose.why_kinds import kinds_help

    # Indented as the docstring around it, so that help's dedent keeps the list's own.
    return "\b\n" + "\n".join("    " + line for line in kinds_help().splitlines())


# The kinds come from the table the verdict uses (diagnose/why_kinds.py), so help lists them all.
why_cmd.__doc__ = why_cmd.__doc__.replace("{KINDS}", _kinds_help())


def _why_job(name: str, kind: str | None, home: str | None, kernel):
    from areal_cli import schedulers, settings
    from areal_cli.diagnose import why
    from areal_cli.errors import UsageError

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
    records = why.record_events(st.state, st.message, servers, scheduler=handle.scheduler)
    return why.diagnose_dir(st.log_dir, kind=handle.kind, records=records, kernel=kernel)


def _render_why(rep, name: str | None) -> None:
    from rich.markup import escape

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
            f"  unsure: {escape(rep.unsure)} (candidates: ranks {_ranks_text(rep.candidates)})"
        )
    if rep.advice:
        out.print(
            f"[bold]advice:[/] [bold]{rep.advice['action']}[/] · {escape(rep.advice['reason'])}"
        )
    if rep.secondary:
        out.print(f"[bold]secondary[/] ({len(rep.secondary)}), each caused by the root cause:")
        # One row per failure, however many ranks show it (addresses and pids aside).
        import re

        rows: dict[tuple, list] = {}
        for e in rep.secondary:
            key = (e.kind, e.source if e.rank is None else None, re.sub(r"\d+", "N", e.message))
            rows.setdefault(key, []).append(e)
        shown = []
        for group in rows.values():
            ranks = sorted({e.rank for e in group if e.rank is not None})
            if ranks:
                who = f"rank{'s' if len(ranks) > 1 else ''} {_ranks_text(ranks)}"
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


# diverge, memory, profile: commands/doctor_more.py
from areal_cli.commands.doctor_more import register as _register_more  # noqa: E402

_register_more(app)
