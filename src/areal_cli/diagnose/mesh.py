"""Device mesh of an allocation: every rank's coordinate per parallel dimension and the ranks of
each process group it belongs to. Pure arithmetic, no torch.

Dimension order, outermost to innermost, as torchtitan builds its DeviceMesh:

    pp, dp, cp, tp

tp is innermost, so a tensor-parallel group is a block of consecutive ranks (on one node when
t divides the GPUs per node); pp is outermost and only shown when the allocation has p > 1.

    rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i

FSDP shards parameters over dp x cp together; when c > 1 that flattened group is listed as
`dp_cp`. Expert parallelism (e) is carved out of other dimensions in framework-specific ways
and is not drawn.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from areal_cli.errors import UsageError

ORDER = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class Mesh:
    alloc: str
    component: str  # backend[name]
    dims: tuple[tuple[str, int], ...]  # outermost first
    ranks: tuple[dict, ...]  # {"rank", "coords": {dim: i}, "groups": {dim: [ranks]}}
    groups: dict[str, list[list[int]]]
    notes: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        n = 1
        for _, size in self.dims:
            n *= size
        return n

    def to_json(self) -> dict:
        return {
            "alloc": self.alloc,
            "component": self.component,
            "world_size": self.world_size,
            "order": "outermost to innermost: " + ", ".join(d for d, _ in self.dims),
            "dims": [{"name": d, "size": s} for d, s in self.dims],
            "ranks": list(self.ranks),
            "groups": self.groups,
            "notes": list(self.notes),
        }


def build(sizes: dict[str, int]) -> tuple[tuple[tuple[str, int], ...], list[dict], dict]:
    """Coordinates and groups for dims given as {name: size} in ORDER."""
    dims = tuple((d, sizes[d]) for d in ORDER if d in sizes)
    names = [d for d, _ in dims]
    shape = [s for _, s in dims]

    def rank_of(coords: tuple[int, ...]) -> int:
        r = 0
        for c, s in zip(coords, shape, strict=True):
            r = r * s + c
        return r

    ranks = []
    for coords in product(*(range(s) for s in shape)):
        ranks.append(
            {"rank": rank_of(coords), "coords": dict(zip(names, coords, strict=True)), "groups": {}}
        )
    ranks.sort(key=lambda r: r["rank"])

    groups: dict[str, list[list[int]]] = {}
    flat = [("dp_cp", ("dp", "cp"))] if sizes.get("cp", 1) > 1 else []
    for gname, members in [(d, (d,)) for d in names] + flat:
        buckets: dict[tuple, list[int]] = {}
        for r in ranks:
            # Ranks of one group agree on every coordinate outside the group's dimensions.
            key = tuple(r["coords"][d] for d in names if d not in members)
            buckets.setdefault(key, []).append(r["rank"])
        groups[gname] = sorted(sorted(b) for b in buckets.values())
        for b in buckets.values():
            for rk in b:
                ranks[rk]["groups"][gname] = sorted(b)
    return dims, ranks, groups


def from_alloc(text: str, name: str | None = None) -> Mesh:
    from areal_cli import alloc

    parsed = alloc.parse(text)
    if name is not None:
        comp = parsed.get(name)
        if comp is None:
            names = [c.name for c in parsed.components if c.name]
            raise UsageError(
                f"no component named {name!r} in {text!r}",
                hint=("components: " + ", ".join(names))
                if names
                else "this allocation has no names",
            )
    else:
        comp = parsed.train or parsed.components[0]
    sizes = {"dp": comp.d, "cp": comp.c, "tp": comp.t}
    if comp.p > 1:
        sizes["pp"] = comp.p
    notes = []
    if comp.e > 1:
        notes.append(f"e{comp.e}: expert-parallel groups are framework-specific and not drawn")
    if comp.role == "inference":
        notes.append(
            f"{comp.backend}: dp is the server replica (d={comp.d}), tp/pp the GPUs inside one server"
        )
    dims, ranks, groups = build(sizes)
    label = comp.backend + (f"[{comp.name}]" if comp.name else "")
    return Mesh(text, label, dims, tuple(ranks), groups, tuple(notes))
