"""`areal doctor mesh`: coordinates and process groups, dims dp, cp, tp with tp innermost."""

from __future__ import annotations

import pytest

from areal_cli.diagnose import mesh
from areal_cli.errors import UsageError


def test_fsdp_d2t2():
    m = mesh.from_alloc("fsdp:d2t2")
    assert [d for d, _ in m.dims] == ["dp", "cp", "tp"]
    assert m.world_size == 4
    assert [r["coords"] for r in m.ranks] == [
        {"dp": 0, "cp": 0, "tp": 0},
        {"dp": 0, "cp": 0, "tp": 1},
        {"dp": 1, "cp": 0, "tp": 0},
        {"dp": 1, "cp": 0, "tp": 1},
    ]
    assert m.groups["tp"] == [[0, 1], [2, 3]]
    assert m.groups["dp"] == [[0, 2], [1, 3]]
    assert m.groups["cp"] == [[0], [1], [2], [3]]
    assert m.ranks[3]["groups"] == {"dp": [1, 3], "cp": [3], "tp": [2, 3]}


def test_context_parallel_adds_the_fsdp_shard_group():
    m = mesh.from_alloc("fsdp:d2c2t2")
    assert m.world_size == 8
    # rank = (dp*C + cp)*T + tp
    assert m.ranks[5]["coords"] == {"dp": 1, "cp": 0, "tp": 1}
    assert m.groups["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert m.groups["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_pipeline_is_outermost_and_train_component_is_chosen():
    m = mesh.from_alloc("sglang:d4+megatron:d2p2t2")
    assert m.component == "megatron"
    assert [d for d, _ in m.dims] == ["pp", "dp", "cp", "tp"]
    assert m.groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert m.to_json()["order"] == "outermost to innermost: pp, dp, cp, tp"


def test_every_rank_is_in_exactly_one_group_per_dim():
    m = mesh.from_alloc("fsdp:d3c2t2")
    for name, groups in m.groups.items():
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(m.world_size)), name


def test_bad_alloc_and_unknown_name_are_usage_errors():
    with pytest.raises(UsageError):
        mesh.from_alloc("d2t2")
    with pytest.raises(UsageError):
        mesh.from_alloc("fsdp:d2", name="actor")
