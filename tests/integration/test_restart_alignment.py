"""A training run restarted against servers an earlier run updated: the servers get the
trainer's weights before its first rollout, and the output says so; fresh servers are left
alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO, areal

SCRIPT = str(REPO / "tests" / "fixtures" / "scripts" / "restart_trainer.py")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from areal_cli.modelgen import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=0)


def _run(tiny, addr: str, key: str, *args: str) -> dict:
    env = {**os.environ, "AREAL_LLM_SERVER_ADDRS": addr, "AREAL_SERVER_BACKEND": "hf",
           "AREAL_API_KEY": key}  # fmt: skip
    res = subprocess.run([sys.executable, SCRIPT, "--model", str(tiny), *args],
                         capture_output=True, text=True, timeout=180, env=env)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_a_restarted_trainer_pushes_its_weights_before_the_first_rollout(tiny, tmp_path):
    out = areal("serve", "--backend", "hf", "--model", str(tiny), "--experiment", "re",
                "--detach", "--json", check=0, timeout=120)  # fmt: skip
    addr = json.loads(out.stdout)["servers"][0]["addr"]
    try:
        key = areal("key", "re/trial0", check=0).stdout.strip()
        # The earlier run, against fresh servers: nothing to align; it leaves version 12.
        first = _run(tiny, addr, key, "--mode", "earlier", "--method", "distributed")
        assert first["synced"] is False and "no sync before the first rollout" in first["line"]
        assert first["before"] < 1e-3 and first["versions"] == {addr: "default"}
        assert first["left"] == "12"
        # The restart loads the checkpoint again; the servers still sample from version 12.
        again = _run(tiny, addr, key, "--mode", "restart", "--method", "disk",
                     "--weights-dir", str(tmp_path / "w"))  # fmt: skip
        assert again["before"] > 0.1, again  # off the trainer's policy, unless aligned
        assert again["synced"] is True and again["after"] < 1e-3, again
        assert f"{addr} holds weight version 12" in again["line"]
        assert f"pushed the trainer's weights ({tiny}) to them" in again["line"]
        assert "version 0 by disk sync" in again["line"]
        assert again["versions"] == {addr: "0"}
    finally:
        areal("stop", "re/trial0", check=0, timeout=60)
