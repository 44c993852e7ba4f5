"""ParallelDims: the one definition of a training mesh (workers, launcher env, doctor)."""

from __future__ import annotations

import pytest

from areal_cli.errors import UsageError
from areal_cli.parallel import ParallelDims


def test_order_is_pp_dp_cp_tp_with_tp_innermost():
    d = ParallelDims(dp=2, cp=2, tp=2)
    assert d.mesh_dims == (("dp", 2), ("cp", 2), ("tp", 2))
    assert d.world_size == 8
    # rank = (dp*C + cp)*T + tp
    assert d.coords(5) == {"dp": 1, "cp": 0, "tp": 1}
    g = d.groups()
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert d.fsdp_dim == "dp_cp"


def test_dp_is_always_in_the_mesh_other_dims_only_when_larger_than_one():
    assert ParallelDims(dp=4).mesh_dims == (("dp", 4),)
    assert ParallelDims(dp=1, tp=2).mesh_dims == (("dp", 1), ("tp", 2))
    assert ParallelDims(dp=2, pp=2).mesh_dims == (("pp", 2), ("dp", 2))
    assert ParallelDims(dp=2, tp=2).fsdp_dim == "dp"


def test_every_rank_is_in_exactly_one_group_per_dim():
    d = ParallelDims(dp=3, cp=2, tp=2, pp=2)
    for name, groups in d.groups().items():
        assert sorted(r for g in groups for r in g) == list(range(d.world_size)), name


def test_from_alloc_takes_the_training_component():
    assert ParallelDims.from_alloc("sglang:d4t2+fsdp:d2c2t2") == ParallelDims(dp=2, cp=2, tp=2)
    # AReaL writes explicit ones (the fsdp:d2p1t1 of its issue #752).
    assert ParallelDims.from_alloc("fsdp:d2p1t1") == ParallelDims(dp=2)


def test_env_round_trip_and_precedence():
    d = ParallelDims(dp=2, cp=1, tp=2)
    assert d.to_env() == "pp=1,dp=2,cp=1,tp=2"
    assert ParallelDims.parse(d.to_env()) == d
    env = {"AREAL_MESH": d.to_env(), "AREAL_ALLOC": "fsdp:d4"}
    assert ParallelDims.from_env(env, 4) == d  # the launcher's mesh wins over the alloc
    assert ParallelDims.from_env({"AREAL_ALLOC": "sglang:d2+fsdp:d2t2c2"}, 8).cp == 2
    assert ParallelDims.from_env({"AREAL_ALLOC": "sglang:d1"}, 3) == ParallelDims(dp=3)
    assert ParallelDims.from_env({}, 3) == ParallelDims(dp=3)


def test_a_world_that_does_not_match_is_a_usage_error():
    with pytest.raises(UsageError) as info:
        ParallelDims.from_env({"AREAL_ALLOC": "fsdp:d4"}, 2)
    assert "--nproc-per-node 4" in (info.value.hint or "")
    with pytest.raises(UsageError):
        ParallelDims.from_env({"AREAL_MESH": "dp=2,tp=2"}, 2)


@pytest.mark.parametrize("bad", ["", "dp", "dp=0", "dp=2,dp=2", "xp=2", "tp=2", "dp=-1"])
def test_bad_mesh_env_is_a_usage_error(bad):
    with pytest.raises(UsageError):
        ParallelDims.from_env({"AREAL_MESH": bad or "x"}, 2)
