"""The doctor draws the mesh the workers really build: real gloo ranks under `areal train`,
every rank's process groups compared with `areal doctor mesh --alloc ... --json`."""

from __future__ import annotations

import json
import textwrap

import pytest
from helpers import areal

WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    from areal_cli.worker import connect, shard_model

    ctx = connect()
    groups = {n: dist.get_process_group_ranks(ctx.mesh[n].get_group())
              for n in ctx.mesh.mesh_dim_names}
    if ctx.dims.cp > 1:
        groups["dp_cp"] = dist.get_process_group_ranks(ctx.mesh["dp_cp"].get_group())

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])

    model = shard_model(Tiny(), ctx.mesh)
    param = next(model.parameters())
    fsdp = dist.get_process_group_ranks(param.device_mesh.get_group())
    out = {"rank": ctx.rank, "groups": groups, "fsdp": fsdp, "mesh_env": os.environ["AREAL_MESH"],
           "dp_rank": ctx.dp_rank, "dp_size": ctx.dp_size}
    with open(os.path.join(sys.argv[1], f"rank{ctx.rank}.json"), "w") as f:
        json.dump(out, f)
    ctx.close()
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("alloc", ["fsdp:d2t2", "fsdp:d2c2"])
def test_worker_groups_equal_the_doctors(tmp_path, alloc):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    areal("train", "--alloc", alloc, "--servers", "none", "--trial", alloc.replace(":", "-"),
          str(script), str(out), timeout=240, check=0)  # fmt: skip
    doctor = json.loads(areal("doctor", "mesh", "--alloc", alloc, "--json", check=0).stdout)
    assert len(list(out.glob("rank*.json"))) == doctor["world_size"] == 4
    for r in doctor["ranks"]:
        got = json.loads((out / f"rank{r['rank']}.json").read_text())
        assert got["groups"] == r["groups"], r["rank"]
        assert got["fsdp"] == r["groups"][doctor["fsdp_dim"]]
        assert got["mesh_env"] == doctor["env"]
        assert got["dp_rank"] == r["coords"]["dp"]
