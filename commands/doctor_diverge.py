"""`areal doctor diverge`: ask a live job's ranks whether the tensors they should share agree."""

from __future__ import annotations

import typer
from rich.markup import escape

from areal_cli import console
from areal_cli.diagnose import diverge
from areal_cli.errors import EXIT_FAILED, ArealError

from .doctor_jobs import find_jobs, live_job_command, print_json


def register(app: typer.Typer) -> None:
    app.command("diverge")(diverge_cmd)


@live_job_command
def diverge_cmd(
    timeout: float = typer.Option(
        60.0, "--timeout", min=1.0, help="Seconds for it all: the ranks' answers and the step."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    **target,
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
    jobs = find_jobs(target)
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
        print_json(results)
    else:
        for r in results:
            _render_diverge(r)
    for r in results:
        if r.report.get("error"):
            raise ArealError(f"the ranks could not run the check: {r.report['error']}")
    if any(not r.report.get("ok") for r in results):
        raise typer.Exit(EXIT_FAILED)


def _render_diverge(r) -> None:
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
