"""`areal train --scheduler ray --max-restarts N` on the real two-node Ray cluster of
tests/ray_cluster.py: torchrun starts again in the same actors (the placement group kept)
when the doctor's root cause says a restart may pass; a bug that would repeat stops at once.
Nothing is left on Ray or the host afterwards."""

from __future__ import annotations

import pytest

from tests.helpers import areal
from tests.integration import restart_checks as rc
from tests.integration.test_ray import marked, ray_left

RAY = ("--scheduler", "ray", "--alloc", "fsdp:d2", "--nnodes", "2", "--servers", "none",
       "--watchdog", "0")  # fmt: skip

pytestmark = pytest.mark.usefixtures("ray_env")


def _nothing_left(cluster, marker: str) -> None:
    assert marked(marker) == []
    left = ray_left(cluster)
    assert not [a for a in left["actors"] if marker in a], left
    assert not [g for g in left["groups"] if marker in g], left


def test_sigkilled_rank_restarts_in_the_same_placement_group(ray_cluster, tmp_path):
    scen = tmp_path / "scen"
    scen.mkdir()
    _, job = rc.killed_step_script([*RAY, "-e", "rs", "-t", "kill"], scen,
                                   ready_s=240, end_s=240, stop_s=120)  # fmt: skip
    _nothing_left(ray_cluster, job["marker"])


@pytest.mark.ray
@pytest.mark.slow
def test_grpo_killed_rank_resumes_from_its_checkpoint(ray_cluster, tmp_path):
    """Issue #26 on Ray: an hf server in a Ray job of its own, the GRPO example on both
    nodes; rank 1 SIGKILLed once a checkpoint exists comes back in the same actors and goes
    on from that checkpoint, with the server brought back to it."""
    from areal_cli.modelgen import create_tiny_model

    tiny = create_tiny_model(tmp_path / "tiny", seed=0)
    with rc.serving("ray", tiny, "rs/grpo", timeout=300) as served:
        _, job = rc.killed_grpo(["--scheduler", "ray", "--alloc", "fsdp:d2", "--nnodes", "2"],
                                "rs/grpo", 10, ready_s=360, end_s=480, stop_s=120)  # fmt: skip
    assert len(job["nodes"]) == 2, job  # the ranks ran on both nodes
    _nothing_left(ray_cluster, job["marker"])
    _nothing_left(ray_cluster, served["marker"])


def test_deterministic_bug_is_not_retried(ray_cluster, tmp_path):
    _, job = rc.bug_not_retried([*RAY, "-e", "rs", "-t", "bug"], tmp_path, timeout=300)
    _nothing_left(ray_cluster, job["marker"])


def test_detached_restarts_are_refused_before_anything_starts(ray_cluster, tmp_path):
    res = areal("train", *RAY, "--max-restarts", "1", "--detach", rc.SCRIPT, check=2, timeout=120)
    assert "--max-restarts on Ray needs the job in the foreground" in res.stderr
    assert "Traceback" not in res.stderr
