"""The hang doctor's collectives come from torch: the stored table matches the installed torch.

When this fails after a torch upgrade, regenerate the table:
    python -m areal_cli.diagnose.collectives && ruff format src/areal_cli/diagnose/torch_collectives.py
"""

from __future__ import annotations

import pytest

from areal_cli.diagnose import collectives, torch_collectives


@pytest.fixture(scope="module")
def derived():
    pytest.importorskip("torch")
    return collectives.derive()


def test_table_matches_the_installed_torch(derived):
    python, ops, unnamed = derived
    assert unnamed == [], "c10d functions torch logs as collectives that no rule names"
    assert python == torch_collectives.PYTHON
    assert ops == torch_collectives.OPS


def test_what_fsdp2_and_the_functional_collectives_wait_in_is_known():
    c10d = torch_collectives.PYTHON[collectives.C10D]
    assert c10d["all_gather_single"] == "all_gather"
    assert c10d["reduce_scatter_single"] == "reduce_scatter"
    funcol = torch_collectives.PYTHON[collectives.FUNCTIONAL]
    assert funcol["wait_tensor"] == "work.wait"
    assert funcol["reduce_scatter_tensor"] == "reduce_scatter"
    assert torch_collectives.OPS["_c10d_functional::all_gather_into_tensor"] == "all_gather"


@pytest.mark.parametrize(
    "name,kind",
    [
        ("_store_based_barrier", "barrier"),
        ("batch_isend_irecv", "send/recv"),
        ("recv_any_source_", "send/recv"),
        ("alltoall_base_", "all_to_all"),
        ("_allgather_base_", "all_gather"),
        ("reduce_scatter_tensor_coalesced_", "reduce_scatter"),
        ("scatter_object_list", "scatter"),
        ("gather_object", "gather"),
        ("reduce", "reduce"),
        ("split_group", "new_group"),
        ("get_rank", None),
        ("destroy_process_group", None),
        ("check_for_nan", None),
    ],
)
def test_names_map_to_the_collective_they_run(name, kind):
    assert collectives.kind_of(name) == kind


def test_lookup_wants_torch_distributed_api_modules():
    site = "/venv/lib/python3.11/site-packages/torch/distributed"
    assert collectives.lookup(f"{site}/distributed_c10d.py", "all_reduce") == "all_reduce"
    assert collectives.lookup(f"{site}/distributed_c10d.py", "all_reduce_multigpu") == "all_reduce"
    assert collectives.lookup(f"{site}/device_mesh.py", "init_device_mesh") == "new_group"
    assert collectives.lookup(f"{site}/fsdp/_fully_shard/_fsdp_collectives.py", "broadcast") is None
    assert collectives.lookup("/home/me/train.py", "all_reduce") is None
