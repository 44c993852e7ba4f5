"""The small rules behind speaking each vLLM version and aligning servers at start."""

from __future__ import annotations

from areal_cli.worker.agree import diverged
from areal_cli.worker.rollout import _version_tuple


def test_vllm_version_strings():
    # What GET /version answers (vllm/_version.py of each build).
    assert _version_tuple("0.32.0") == (0, 32)
    assert _version_tuple("0.33.1rc2.dev5+gabc1234") == (0, 33)
    assert _version_tuple("1.0") == (1, 0)
    for junk in (None, "", "dev", "0", "x.1", {"v": 1}):
        assert _version_tuple(junk) is None


def test_which_servers_need_the_trainers_weights(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    link = tmp_path / "link"
    link.symlink_to(model)
    states = {
        "a:1": {"weight_version": "default", "model_path": str(model)},
        "b:1": {"weight_version": "default", "model_path": str(link) + "/"},  # same folder
        "c:1": {"weight_version": "12", "model_path": str(model)},  # an earlier run's sync
        "d:1": {"weight_version": "default", "model_path": str(tmp_path / "ckpt")},  # moved
        "e:1": {"weight_version": None, "model_path": "org/name"},  # vLLM without dev routes
    }
    got = diverged(states, str(model))
    assert set(got) == {"c:1", "d:1", "e:1"}
    assert got["c:1"] == f"holds weight version 12 (model {model})"
    assert got["d:1"] == f"serves {tmp_path / 'ckpt'}, not {model}"
    assert diverged({"h:1": {"weight_version": None, "model_path": "org/name"}}, "org/name") == {}
