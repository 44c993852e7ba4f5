"""`areal doctor memory`: each rank's memory beside the host's and the cgroup's limits."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from areal_cli import console
from areal_cli.diagnose import memory

from .doctor_jobs import find_jobs, live_job_command, print_json


def register(app: typer.Typer) -> None:
    app.command("memory")(memory_cmd)


@live_job_command
def memory_cmd(
    snapshot: Path = typer.Option(
        None,
        "--snapshot",
        help="Write each rank's memory snapshot here (CUDA: torch's, for "
        "pytorch.org/memory_viz; CPU: the RSS breakdown from smaps_rollup).",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    **target,
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
    reports = [memory.gather(j, snapshot) for j in find_jobs(target)]
    if json_out:
        print_json(reports)
        return
    for rep in reports:
        _render_memory(rep)


def _render_memory(rep) -> None:
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


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
