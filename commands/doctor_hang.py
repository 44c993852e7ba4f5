"""`areal doctor hang`'s run and rendering, free of typer so that plain calls skip its import.

areal_cli.cli hands `doctor hang` with nothing but known flags and well-formed values to
`parse_plain` and `run`; anything else (help, an unknown flag, a bad value) goes through
typer, whose definition in commands/doctor.py owns the flags' help and their error messages.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from pathlib import Path

STATE_STYLE = {
    "collective": "cyan",
    "busy": "magenta",
    "idle": "blue",
    "missing": "red",
    "error": "red",
    "stopped": "red",
}


def _path(value: str) -> Path:
    from pathlib import Path  # only with --out: pathlib is no import before the first dump

    return Path(value)


# flag: (keyword, type); the bounds are typer's in commands/doctor.py.
_VALUED = {
    "--pid": ("pid", int),
    "-p": ("pid", int),
    "--job": ("job", str),
    "-j": ("job", str),
    "--samples": ("samples", int),
    "-n": ("samples", int),
    "--interval": ("interval", float),
    "--timeout": ("timeout", float),
    "--out": ("out_dir", _path),
    "--home": ("home", str),
    "--registry": ("registry", str),
}
_FLAGS = {"--native": "native", "--locals": "show_locals", "--json": "json_out"}
_BOUNDS = {"samples": (1, 100), "interval": (0.0, None), "timeout": (0.5, None)}


def defaults() -> dict:
    return {
        "pid": [],
        "job": None,
        "samples": 3,
        "interval": 0.5,
        "native": False,
        "show_locals": False,
        "timeout": 10.0,
        "json_out": False,
        "out_dir": None,
        "home": None,
        "registry": None,
    }


def parse_plain(args: list[str]) -> dict | None:
    """`run`'s keywords from `args`, or None for anything typer should parse and judge."""
    opts = defaults()
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in _FLAGS:
            opts[_FLAGS[arg]] = True
            i += 1
            continue
        name, eq, value = arg.partition("=")
        if name not in _VALUED or (eq and not name.startswith("--")):
            return None
        if not eq:
            if i + 1 >= len(args) or args[i + 1].startswith("-"):
                return None
            value = args[i + 1]
            i += 1
        i += 1
        key, kind = _VALUED[name]
        if not value.strip():  # an empty --out or --home: typer's message
            return None
        try:
            parsed = kind(value)
        except ValueError:
            return None
        if kind is float and parsed - parsed != 0:
            return None  # nan or inf (x - x is nan for both): typer's message
        lo, hi = _BOUNDS.get(key, (None, None))
        if (lo is not None and parsed < lo) or (hi is not None and parsed > hi):
            return None
        if key == "pid":
            opts["pid"].append(parsed)
        else:
            opts[key] = parsed
    return opts


def run(
    pid: list[int],
    job: str | None,
    samples: int,
    interval: float,
    native: bool,
    show_locals: bool,
    timeout: float,
    json_out: bool,
    out_dir: Path | None,
    home: str | None,
    registry: str | None = None,
) -> int:
    """Dump, judge and print; the exit code (1 when a dump failed; a hang found is 0)."""
    import time

    if registry:
        from areal_cli import settings

        settings.use_registry(registry)

    from areal_cli.diagnose import hang, targets
    from areal_cli.errors import UsageError

    if pid and job:
        raise UsageError("give --pid or --job, not both")
    found_at = time.monotonic()
    jobs = targets.resolve(pids=list(pid or []), job=job, home=home)
    find_s = time.monotonic() - found_at
    nranks = sum(len(j.ranks) for j in jobs)
    status = None
    if not json_out:  # else console (and typing with it) once the dumps are done
        from areal_cli import console

        if console.err.is_terminal:
            status = console.err.status(f"dumping {nranks} rank(s)...")
            status.start()

    def progress(sample: int, done: int, total: int) -> None:
        if status is not None:
            label = f" (sample {sample + 1}/{samples})" if samples > 1 else ""
            status.update(f"dumping {done}/{total} rank(s){label}...")

    try:
        reports = hang.diagnose(
            jobs,
            samples=samples,
            interval=interval,
            native=native,
            show_locals=show_locals,
            timeout=timeout,
            on_progress=progress,
            torch_analyzer=bool(out_dir),  # seconds of torch's import: for the bundle only
        )
    finally:
        if status is not None:
            status.stop()
    from areal_cli import console, settings

    hang.note_refused(reports, settings.registry_url())
    written = hang.write_bundle(reports, out_dir) if out_dir else []
    if json_out:
        data = hang.to_json(reports)
        data["timing"]["find_s"] = round(find_s, 4)
        if out_dir:
            data["out"] = str(out_dir)
        console.print_json(data)
    else:
        for i, rep in enumerate(reports):
            if i:
                console.out.print()
            render_hang(rep, show_locals=show_locals)
        if written:
            console.out.print(f"[dim]raw dumps and summary.json written to {out_dir}[/]")
    if any(rep.failed for rep in reports):
        for rep in reports:
            for e in rep.errors:
                who = (
                    f"node {e['node']}"
                    if e.get("rank") is None and e.get("node")
                    else (f"rank {e['rank']} (pid {e['pid']})")
                )
                console.err.print(f"[red]{who}: {e['error']}[/]")
                if e.get("fix"):
                    console.err.print(f"[yellow]fix:[/] {e['fix']}")
        return _leaving(1)
    return _leaving(0)


def _leaving(code: int) -> int:
    """`code`, once the collector no longer looks at what is alive now: the process ends next,
    and its last collection walked every module, dump and report (16 ranks: 10.6-14.4 ms from
    the last atexit hook to the exit, 4.0-4.7 ms without that walk)."""
    import gc

    gc.freeze()
    return code


def render_hang(rep, show_locals: bool = False) -> None:
    from rich.markup import escape
    from rich.tree import Tree

    from areal_cli import console

    a = rep.analysis
    v = a.verdict
    job = rep.job
    head = f"[bold]{escape(job.label)}[/] · world size {job.world_size}"
    if job.multi_host:
        head += f" · this host: ranks {_ranks_text(job.expected_local_ranks())}"
    head += f" · {rep.samples} sample{'s' if rep.samples > 1 else ''}"
    console.out.print(head)
    odd = set(v.odd_ranks) if v else set()
    # A cluster job's ranks run on several nodes: say which.
    node_of = {r.rank: r.node for r in job.ranks if r.node}

    def pid_text(rank: int, pid) -> str:
        return f"{pid} on {node_of[rank]}" if rank in node_of else str(pid)

    if v is not None:
        color = "bold red" if v.is_hang else "green"
        console.out.print(f"verdict: [{color}]{v.kind}[/]")
        console.out.print(f"  {escape(v.summary)}")
        if v.certainty:
            console.out.print(f"  [dim]how sure ({v.confidence}): {escape(v.certainty)}[/]")
        if v.odd_ranks:
            where = sorted({node_of[r] for r in v.odd_ranks if r in node_of})
            on = f" (node {', '.join(where)})" if where else ""
            console.out.print(f"  odd ranks: [bold red]{_ranks_text(v.odd_ranks)}[/]{on}")
        elif v.candidates:  # the evidence cannot tell which side is wrong: none is named
            console.out.print(f"  odd ranks: unknown (candidates {_ranks_text(v.candidates)})")
        if v.hint:
            console.out.print(f"  [yellow]hint:[/] {escape(v.hint)}")
        if v.is_hang and v.advice_reason:
            console.out.print(f"  advice: [bold]{v.advice}[/] ({escape(v.advice_reason)})")
        for rank, e in sorted(v.reached.items()):  # from the flight recorder
            console.out.print(f"  [dim]rank {rank}: {escape(e.label())}[/]")
    tree = Tree(f"[bold]{escape(job.label)}[/]", guide_style="dim")
    by_rank = {r.rank: r for r in a.ranks}
    for g in a.groups:
        members = [by_rank[r] for r in g.ranks]
        is_odd = any(r in odd for r in g.ranks)
        style = STATE_STYLE.get(g.state, "white")
        what = {"collective": f"waits in {g.collective}", "busy": "computing", "idle": "idle"}.get(
            g.state, g.state
        )
        pids = ", ".join(pid_text(m.rank, m.pid) for m in members)
        where = f" at {escape(g.frame.where())} in {escape(g.frame.function)}" if g.frame else ""
        label = (
            f"{'[bold red]✗[/] ' if is_odd else '● '}[bold]{_rank_word(g.ranks)}[/] "
            f"[dim](pid {pids})[/] — [{style}]{what}[/]{where}"
        )
        threads = {m.thread for m in members if m.thread and m.thread != "MainThread"}
        if threads:
            label += f" [dim](thread {escape(', '.join(sorted(threads)))})[/]"
        progress = {m.progress for m in members if m.progress}
        if progress:
            label += f" [dim]\\[{', '.join(sorted(progress))}][/]"
        node = tree.add(label)
        for f in reversed(g.stack):  # outermost first, like a traceback
            user = g.frame is not None and f == g.frame
            text = f"{escape(f.function)}  [dim]{escape(f.where())}[/]"
            if f.native:
                text = f"{escape(_short_native(f.function))}  [dim]{escape(f.where())}[/]"
            if user:
                text = f"[bold yellow]{escape(f.function)}  {escape(f.where())}  ◀ your code[/]"
                if f.code:
                    text += f"\n[yellow]    {escape(f.code)}[/]"
            elif f.native:
                text = f"[dim]{escape(_short_native(f.function))}  {escape(f.where())}[/]"
            fnode = node.add(text)
            if show_locals and f.locals:
                for name, value in f.locals[:12]:
                    fnode.add(f"[dim]{escape(name)} = {escape(value[:80])}[/]")
    for r in a.ranks:
        if r.state in ("missing", "error"):
            reason = escape(r.error or r.state)
            pid = f" [dim](pid {pid_text(r.rank, r.pid)})[/]" if r.pid else ""
            tree.add(f"[bold red]✗ rank {r.rank}[/]{pid} — [red]{r.state}[/]: {reason}")
    # Wrap long frames instead of cutting them: the file:line at the end is the point.
    console.out.print(tree, soft_wrap=False)


def _short_native(name: str, limit: int = 100) -> str:
    """C++ symbols without template arguments and parameter lists: `a::b<...>::c(...)` -> `a::b<>::c()`."""
    out, depth = [], 0
    for ch in name:
        if ch in "<(":
            if depth == 0:
                out.append(ch)
            depth += 1
        elif ch in ">)" and depth:
            depth -= 1
            if depth == 0:
                out.append(ch)
        elif depth == 0:
            out.append(ch)
    text = "".join(out)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _rank_word(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + _ranks_text(ranks)


def _ranks_text(ranks) -> str:
    from areal_cli.diagnose.verdict import _compress

    return _compress(sorted(ranks))
