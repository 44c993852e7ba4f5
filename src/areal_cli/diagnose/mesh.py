"""`areal doctor mesh`: every rank's coordinate per mesh dimension and the ranks of each process
group, exactly as the workers build them (both use areal_cli.parallel.ParallelDims).

Expert parallelism (e) is carved out of other dimensions in framework-specific ways and is not
drawn; inference components are drawn as replicas (dp) of t·p GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_cli import alloc
from areal_cli.errors import UsageError
from areal_cli.parallel import ParallelDims


@dataclass(frozen=True)
class Mesh:
    alloc: str
    component: str  # backend[name]
    dims: ParallelDims
    notes: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.dims.mesh_dims]

    @property
    def groups(self) -> dict[str, list[list[int]]]:
        return self.dims.groups()

    @property
    def ranks(self) -> list[dict]:
        groups = self.groups
        return [
            {
                "rank": r,
                "coords": self.dims.coords(r),
                "groups": {g: next(b for b in bs if r in b) for g, bs in groups.items()},
            }
            for r in range(self.world_size)
        ]

    def to_json(self) -> dict:
        return {
            "alloc": self.alloc,
            "component": self.component,
            "world_size": self.world_size,
            "order": "outermost to innermost: " + ", ".join(self.names),
            "dims": [{"name": d, "size": s} for d, s in self.dims.mesh_dims],
            "fsdp_dim": self.dims.fsdp_dim,
            "env": self.dims.to_env(),
            "ranks": self.ranks,
            "groups": self.groups,
            "notes": list(self.notes),
        }


def from_alloc(text: str, name: str | None = None) -> Mesh:
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
    notes = []
    if comp.e > 1:
        notes.append(f"e{comp.e}: expert-parallel groups are framework-specific and not drawn")
    if comp.role == "inference":
        notes.append(
            f"{comp.backend}: dp is the server replica (d={comp.d}), tp/pp the GPUs inside one server"
        )
    else:
        notes.append(f"FSDP shards parameters over {ParallelDims.from_component(comp).fsdp_dim}")
    label = comp.backend + (f"[{comp.name}]" if comp.name else "")
    return Mesh(text, label, ParallelDims.from_component(comp), tuple(notes))
