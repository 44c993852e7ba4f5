"""Flags over the job YAML for the keys that determine one another (alloc, backend, dp, tp),
and a model path that is not on this host (a dry run plans with it)."""

from __future__ import annotations

import pytest

from areal_cli import jobspec, models
from areal_cli.errors import UsageError

YAML = {"backend": "sglang", "alloc": "sglang:d4t1", "dp": None}


@pytest.mark.parametrize(
    "flags, want, note",
    [
        ({}, {"backend": "sglang", "alloc": "sglang:d4t1"}, None),
        ({"backend": "hf"}, {"alloc": "hf:d4t1"},
         "--backend hf rewrote the job YAML's alloc sglang:d4t1 as hf:d4t1"),
        ({"dp": 2, "tp": 2}, {"alloc": "sglang:d2t2"},
         "--dp 2 --tp 2 rewrote the job YAML's alloc sglang:d4t1 as sglang:d2t2"),
        ({"alloc": "vllm:d1t2"}, {"alloc": "vllm:d1t2"},
         "--alloc vllm:d1t2 replaces the job YAML's backend: sglang"),
        # A flag the YAML does not contradict changes nothing else.
        ({"backend": "sglang"}, {"alloc": "sglang:d4t1"}, None),
    ],
)  # fmt: skip
def test_a_flag_wins_with_what_it_determines(flags, want, note):
    got, notes = jobspec.serve_shape({"alloc": None, "backend": None, **flags}, YAML)
    assert got == want
    assert notes == ([] if note is None else [note])


def test_pipeline_dims_survive_a_rewrite():
    got, _ = jobspec.serve_shape({"backend": "vllm"}, {"alloc": "sglang:d2t2p2"})
    assert got == {"alloc": "vllm:d2t2p2"}


def test_a_yaml_alloc_with_a_train_part_is_refused_by_name():
    with pytest.raises(UsageError, match="not one inference component"):
        jobspec.serve_shape({"backend": "hf"}, {"alloc": "sglang:d1+fsdp:d2"})


def test_a_missing_model_is_refused_unless_missing_is_allowed(tmp_path):
    missing = tmp_path / "models" / "m"
    with pytest.raises(UsageError, match="does not exist"):
        models.parse(str(missing))
    ref = models.parse(str(missing), missing_ok=True)
    assert (ref.name, ref.found, ref.local) == (str(missing), False, True)
    (tmp_path / "runs").mkdir()
    ref = models.parse("runs/ckpt", cwd=tmp_path, missing_ok=True)  # a typo'd local path
    assert (ref.name, ref.found) == (str(tmp_path / "runs" / "ckpt"), False)
    assert models.parse("org/name", cwd=tmp_path, missing_ok=True).local is False
