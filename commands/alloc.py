"""`areal alloc`: explain an allocation string (components, dims, GPUs) or say what is wrong."""

from __future__ import annotations

from areal_cli import alloc, console
from areal_cli.commands import Opt

HELP = """Explain an allocation string: its components, parallel dims and GPU count.

[bold]Grammar[/]: AReaL's. backend\\[name]:dims, joined by [bold]+[/] (separate GPUs) or [bold]|[/] (shared GPUs, names required). Inference backends sglang, vllm, hf take d (replicas), t, p; fsdp takes d, t, c (p and e only as 1); megatron and archon take d, t, p, c, e. World size = d·t·p·c.

\b
Examples:
  areal alloc sglang:d4t2+fsdp:d8
  areal alloc 'sglang\\[rollout]:d2+fsdp\\[actor]:d4|fsdp\\[critic]:d4'
  areal alloc 'megatron:(attn:d1p2t2c2|ffn:p2e4)' --json

A bad string is shown with a caret under the problem and a hint (exit 2).
"""


# The option of `areal alloc S`, for its typer command and its plain form alike.
OPTIONS = [Opt("json_out", "--json", kind=bool, default=False, help="Print the parse as JSON.")]


def plain(text: str, json_out: bool) -> int:
    show(text, json_out)
    return 0


def register(app) -> None:
    # typer is imported here only: `areal alloc S [--json]` runs `show` straight from
    # areal_cli.cli, without typer's 50 ms of start-up.
    import typer

    @app.command("alloc", help=HELP)
    def _cmd(
        text: str = typer.Argument(..., metavar="STRING", help="The allocation string."),
        json_out: bool = OPTIONS[0].option(),
    ) -> None:
        show(text, json_out)


def show(text: str, json_out: bool) -> None:
    allocation = alloc.parse(text)
    if json_out:
        console.print_json(allocation.to_json())
        return
    console.out.print(render(allocation))


def render(allocation):
    """A rich table of the components plus the total; MoE expert dims as a caption."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    table = Table(
        title=escape(allocation.text),
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    for header in ("name", "backend", "role"):
        table.add_column(header, no_wrap=True)
    for header in "dtpce":
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column("world", justify="right", no_wrap=True)
    table.add_column("per rep", justify="right", no_wrap=True)
    table.add_column("colocated", no_wrap=True)

    sharers: dict[str, list[str]] = {}
    for comp in allocation.components:
        if comp.colocate_with:
            sharers.setdefault(comp.colocate_with, []).append(comp.name or "")
    notes = []
    for comp in allocation.components:
        if comp.colocate_with:
            coloc = escape(comp.colocate_with)
        elif comp.name in sharers:
            coloc = escape(", ".join(sharers[comp.name]))
        else:
            coloc = "[dim]-[/]"
        role_style = "cyan" if comp.role == "inference" else "magenta"
        table.add_row(
            escape(comp.name) if comp.name else "[dim]-[/]",
            comp.backend,
            f"[{role_style}]{comp.role}[/]",
            *(str(getattr(comp, k)) for k in "dtpce"),
            str(comp.world_size),
            str(comp.gpus_per_replica),
            coloc,
        )
        if comp.ffn is not None:
            f = comp.ffn
            label = escape(comp.name or comp.backend)
            notes.append(f"{label} experts (ffn): d{f.d} t{f.t} p{f.p} e{f.e}")
    total = allocation.world_size
    notes.append(f"[bold]total world size: {total} GPU{'s' if total != 1 else ''}[/]")
    table.caption = "\n".join(notes)
    table.caption_justify = "left"
    return table
