"""`areal doctor mesh`: every rank's coordinates in an allocation's device mesh, its groups."""

from __future__ import annotations

import typer
from rich.table import Table

from areal_cli import console
from areal_cli.diagnose import mesh
from areal_cli.parallel import ORDER


def register(app: typer.Typer) -> None:
    app.command("mesh")(mesh_cmd)


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
    m = mesh.from_alloc(alloc, name)
    if json_out:
        console.print_json(m.to_json())
        return
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
