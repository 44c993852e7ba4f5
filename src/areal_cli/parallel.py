"""The device mesh of an allocation: one definition for the workers, the launcher and the doctor.

Dimensions, outermost to innermost, in torchtitan's order:

    pp, dp, cp, tp        rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i

tp is innermost, so a tensor-parallel group is a block of consecutive ranks (on one node when
t divides the GPUs per node). The DeviceMesh holds dp always (code may ask for `mesh["dp"]`)
and every other dimension larger than one. FSDP shards parameters over dp and cp together, as
torchtitan's `dp_shard_cp` does: when c > 1 that flattened dimension is called `dp_cp`.

The arithmetic needs no torch, so `areal doctor mesh` and the launcher use it on the CLI's
start-up path; only `build_mesh` imports torch, inside a worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from areal_cli.errors import UsageError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from areal_cli.alloc import Component

ORDER = ("pp", "dp", "cp", "tp")
FLAT_FSDP = "dp_cp"
# What the launcher exports to every worker, e.g. "pp=1,dp=2,cp=1,tp=2".
MESH_ENV = "AREAL_MESH"


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    cp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ORDER:
            size = getattr(self, name)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise UsageError(f"mesh dimension {name}={size!r} must be an integer >= 1")

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def from_component(cls, comp: Component) -> ParallelDims:
        return cls(dp=comp.d, cp=comp.c, tp=comp.t, pp=comp.p)

    @classmethod
    def from_alloc(cls, text: str) -> ParallelDims:
        """The training component's dims (or the first component's, for inference only)."""
        from areal_cli.alloc import parse

        parsed = parse(text)
        return cls.from_component(parsed.train or parsed.components[0])

    @classmethod
    def from_env(cls, env: Mapping[str, str], world_size: int) -> ParallelDims:
        """What a worker runs on: AREAL_MESH from the launcher, else the training component of
        AREAL_ALLOC, else plain data parallelism over the whole world. Checked against the
        world the worker actually joined."""
        raw = env.get(MESH_ENV)
        alloc = env.get("AREAL_ALLOC")
        if raw:
            dims = cls.parse(raw)
            source = f"{MESH_ENV}={raw}"
        elif alloc:
            from areal_cli.alloc import parse

            train = parse(alloc).train
            dims = cls.from_component(train) if train else cls(dp=world_size)
            source = f"allocation {alloc!r}"
        else:
            return cls(dp=world_size)
        if dims.world_size != world_size:
            raise UsageError(
                f"{source} wants {dims.world_size} training ranks but this job has "
                f"WORLD_SIZE={world_size}",
                hint=f"launch with --nproc-per-node {dims.world_size} "
                "(`areal train` does this from --alloc)",
            )
        return dims

    @classmethod
    def parse(cls, text: str) -> ParallelDims:
        sizes: dict[str, int] = {}
        for part in text.split(","):
            name, sep, value = part.strip().partition("=")
            if not sep or name not in ORDER or name in sizes or not value.isdigit():
                raise UsageError(
                    f"{MESH_ENV}={text!r} is not a mesh", hint="e.g. AREAL_MESH=pp=1,dp=2,cp=1,tp=2"
                )
            sizes[name] = int(value)
        if "dp" not in sizes:
            raise UsageError(f"{MESH_ENV}={text!r} has no dp")
        return cls(**sizes)

    def to_env(self) -> str:
        return ",".join(f"{name}={getattr(self, name)}" for name in ORDER)

    # -- arithmetic -----------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def mesh_dims(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of the DeviceMesh's dimensions, outermost first."""
        return tuple(
            (name, getattr(self, name)) for name in ORDER if name == "dp" or getattr(self, name) > 1
        )

    @property
    def fsdp_dim(self) -> str:
        """The mesh dimension FSDP shards over."""
        return FLAT_FSDP if self.cp > 1 else "dp"

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh dimension."""
        if not 0 <= rank < self.world_size:
            raise UsageError(f"rank {rank} is outside a world of {self.world_size}")
        out: dict[str, int] = {}
        for name, size in reversed(self.mesh_dims):
            rank, out[name] = divmod(rank, size)
        return {name: out[name] for name, _ in self.mesh_dims}

    def groups(self) -> dict[str, list[list[int]]]:
        """Every process group of the mesh, by dimension name (plus dp_cp when c > 1)."""
        names = [n for n, _ in self.mesh_dims]
        members = {n: (n,) for n in names}
        if self.cp > 1:
            members[FLAT_FSDP] = ("dp", "cp")
        ranks = [self.coords(r) for r in range(self.world_size)]
        out: dict[str, list[list[int]]] = {}
        for gname, dims in members.items():
            buckets: dict[tuple[int, ...], list[int]] = {}
            for r, coords in enumerate(ranks):
                # Ranks of one group agree on every coordinate outside the group's dimensions.
                key = tuple(coords[d] for d in names if d not in dims)
                buckets.setdefault(key, []).append(r)
            out[gname] = sorted(buckets.values())
        return out

    def rank_groups(self, rank: int) -> dict[str, list[int]]:
        return {
            name: next(g for g in groups if rank in g) for name, groups in self.groups().items()
        }

    # -- torch ----------------------------------------------------------------------------

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The DeviceMesh of these dims (collective: every rank calls it), with dp_cp
        flattened when c > 1 so FSDP can shard over it."""
        from torch.distributed.device_mesh import init_device_mesh

        names = tuple(n for n, _ in self.mesh_dims)
        mesh = init_device_mesh(
            device_type, tuple(s for _, s in self.mesh_dims), mesh_dim_names=names
        )
        if self.cp > 1:
            # torch has no public flatten yet; torchtitan uses the same call.
            mesh["dp", "cp"]._flatten(mesh_dim_name=FLAT_FSDP)
        return mesh


def describe(dims: ParallelDims) -> str:
    return " × ".join(f"{n}={s}" for n, s in dims.mesh_dims)


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The part of a mesh FSDP shards over: dp_cp when the mesh has cp, else dp (a mesh
    without named dims is taken whole)."""
    names = mesh.mesh_dim_names or ()
    if "cp" in names:
        return mesh[FLAT_FSDP]
    return mesh["dp"] if "dp" in names else mesh
