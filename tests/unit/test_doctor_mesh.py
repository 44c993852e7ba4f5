"""`areal doctor mesh`: coordinates and process groups as the workers build them."""

from __future__ import annotations

import pytest

from areal_cli.diagnose import mesh
from areal_cli.errors import UsageError


def test_fsdp_d2t2():
    m = mesh.from_alloc("fsdp:d2t2")
    assert m.names == ["dp", "tp"]
    assert m.world_size == 4
    assert [r["coords"] for r in m.ranks] == [
        {"dp": 0, "tp": 0},
        {"dp": 0, "tp": 1},
        {"dp": 1, "tp": 0},
        {"dp": 1, "tp": 1},
    ]
    assert m.groups["tp"] == [[0, 1], [2, 3]]
    assert m.groups["dp"] == [[0, 2], [1, 3]]
    assert m.ranks[3]["groups"] == {"dp": [1, 3], "tp": [2, 3]}
    assert m.to_json()["env"] == "pp=1,dp=2,cp=1,tp=2"


def test_context_parallel_adds_the_fsdp_shard_group():
    m = mesh.from_alloc("fsdp:d2c2t2")
    assert m.world_size == 8
    assert m.ranks[5]["coords"] == {"dp": 1, "cp": 0, "tp": 1}
    assert m.groups["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert m.groups["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert m.to_json()["fsdp_dim"] == "dp_cp"


def test_pipeline_is_outermost_and_train_component_is_chosen():
    m = mesh.from_alloc("sglang:d4+megatron:d2p2t2")
    assert m.component == "megatron"
    assert m.names == ["pp", "dp", "tp"]
    assert m.groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert m.to_json()["order"] == "outermost to innermost: pp, dp, tp"


def test_bad_alloc_and_unknown_name_are_usage_errors():
    with pytest.raises(UsageError):
        mesh.from_alloc("d2t2")
    with pytest.raises(UsageError):
        mesh.from_alloc("fsdp:d2", name="actor")
