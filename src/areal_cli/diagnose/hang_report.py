"""A hang report as the terminal shows it: the verdict's lines, then every group of ranks as a
tree of its stack (outermost frame first, the user's frame marked). Built here, printed by the
command: `doctor hang`, and `doctor allreduce` when its repro hangs."""

from __future__ import annotations

from rich.markup import escape
from rich.tree import Tree

from areal_cli.diagnose.verdict import _compress

STATE_STYLE = {
    "collective": "cyan",
    "busy": "magenta",
    "idle": "blue",
    "missing": "red",
    "error": "red",
    "stopped": "red",
}


def render(rep, show_locals: bool = False) -> tuple[list[str], Tree]:
    """(the head and verdict, as lines of markup; the tree of rank groups)."""
    job = rep.job
    head = f"[bold]{escape(job.label)}[/] · world size {job.world_size}"
    if job.multi_host:
        head += f" · this host: ranks {ranks_text(job.expected_local_ranks())}"
    head += f" · {rep.samples} sample{'s' if rep.samples > 1 else ''}"
    # A cluster job's ranks run on several nodes: say which.
    node_of = {r.rank: r.node for r in job.ranks if r.node}
    lines = [head, *_verdict_lines(rep.analysis.verdict, node_of)]
    return lines, _tree(rep, node_of, show_locals)


def _verdict_lines(v, node_of: dict[int, str]) -> list[str]:
    if v is None:
        return []
    color = "bold red" if v.is_hang else "green"
    lines = [f"verdict: [{color}]{v.kind}[/]", f"  {escape(v.summary)}"]
    if v.certainty:
        lines.append(f"  [dim]how sure ({v.confidence}): {escape(v.certainty)}[/]")
    if v.odd_ranks:
        where = sorted({node_of[r] for r in v.odd_ranks if r in node_of})
        on = f" (node {', '.join(where)})" if where else ""
        lines.append(f"  odd ranks: [bold red]{ranks_text(v.odd_ranks)}[/]{on}")
    elif v.candidates:  # the evidence cannot tell which side is wrong: none is named
        lines.append(f"  odd ranks: unknown (candidates {ranks_text(v.candidates)})")
    if v.hint:
        lines.append(f"  [yellow]hint:[/] {escape(v.hint)}")
    if v.is_hang and v.advice_reason:
        lines.append(f"  advice: [bold]{v.advice}[/] ({escape(v.advice_reason)})")
    for rank, e in sorted(v.reached.items()):  # from the flight recorder
        lines.append(f"  [dim]rank {rank}: {escape(e.label())}[/]")
    return lines


def _tree(rep, node_of: dict[int, str], show_locals: bool) -> Tree:
    a = rep.analysis
    odd = set(a.verdict.odd_ranks) if a.verdict else set()

    def pid_text(rank: int, pid) -> str:
        return f"{pid} on {node_of[rank]}" if rank in node_of else str(pid)

    tree = Tree(f"[bold]{escape(rep.job.label)}[/]", guide_style="dim")
    by_rank = {r.rank: r for r in a.ranks}
    for g in a.groups:
        members = [by_rank[r] for r in g.ranks]
        pids = ", ".join(pid_text(m.rank, m.pid) for m in members)
        node = tree.add(_group_label(g, members, pids, any(r in odd for r in g.ranks)))
        for f in reversed(g.stack):  # outermost first, like a traceback
            fnode = node.add(_frame_text(f, user=g.frame is not None and f == g.frame))
            if show_locals and f.locals:
                for name, value in f.locals[:12]:
                    fnode.add(f"[dim]{escape(name)} = {escape(value[:80])}[/]")
    for r in a.ranks:
        if r.state in ("missing", "error"):
            reason = escape(r.error or r.state)
            pid = f" [dim](pid {pid_text(r.rank, r.pid)})[/]" if r.pid else ""
            tree.add(f"[bold red]✗ rank {r.rank}[/]{pid} — [red]{r.state}[/]: {reason}")
    return tree


def _group_label(g, members, pids: str, is_odd: bool) -> str:
    style = STATE_STYLE.get(g.state, "white")
    what = {"collective": f"waits in {g.collective}", "busy": "computing", "idle": "idle"}.get(
        g.state, g.state
    )
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
    return label


def _frame_text(f, user: bool) -> str:
    if user:
        text = f"[bold yellow]{escape(f.function)}  {escape(f.where())}  ◀ your code[/]"
        if f.code:
            text += f"\n[yellow]    {escape(f.code)}[/]"
        return text
    if f.native:
        return f"[dim]{escape(short_native(f.function))}  {escape(f.where())}[/]"
    return f"{escape(f.function)}  [dim]{escape(f.where())}[/]"


def short_native(name: str, limit: int = 100) -> str:
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
    return ("rank " if len(ranks) == 1 else "ranks ") + ranks_text(ranks)


def ranks_text(ranks) -> str:
    """Ranks as ranges: 0-3,5."""
    return _compress(sorted(ranks))
