"""Servers that heal on the cluster schedulers: the replica runner is the same in a Slurm
step and in a Ray actor, so a server SIGKILLed there comes back on its address, registered
again with its restart counted (`areal ps` lists it all along), and the job's stop leaves
nothing (stand-in servers, tests/fixtures/fake_python.py; the clusters of tests/services.py)."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

from areal_cli.registry import open_registry
from tests.helpers import FAKE_PYTHON, areal, wait_for

FAKE = ("--backend", "hf", "--model", "org/tiny", "--python", FAKE_PYTHON, "--alloc", "hf:d1")


def _killed_server_comes_back(scheduler: str, registry) -> None:
    res = areal("serve", "--scheduler", scheduler, *FAKE, "--detach", "--json", timeout=180)
    assert res.returncode == 0, res.stderr
    reg = open_registry(registry)
    try:
        (entry,) = reg.list("default", "trial0").servers
        os.kill(entry.pid, signal.SIGKILL)

        def back():
            # While it heals (out of discovery, then started again) `areal ps` still lists
            # the replica, on its address, and the job as running: never a missing row.
            (job,) = [j for j in json.loads(areal("ps", "--json", check=0).stdout)
                      if j["scheduler"] == scheduler]  # fmt: skip
            assert [s["addr"] for s in job["servers"]] == [entry.addr], job
            assert job["state"] == "running", job
            listed = reg.list("default", "trial0").servers
            return listed if listed and listed[0].restarts == 1 else None

        (again,) = wait_for(back, 60, "the killed server never came back")
        assert again.addr == entry.addr and again.pid != entry.pid and again.node == entry.node
        (job,) = [j for j in json.loads(areal("ps", "--json", check=0).stdout)
                  if j["scheduler"] == scheduler]  # fmt: skip
        assert job["state"] == "running"
        assert [s["restarts"] for s in job["servers"]] == [1] and job["servers"][0]["healthy"]
        logs = areal("logs", "default/trial0", check=0).stdout
        assert "restart 1: registered" in logs
    finally:
        areal("stop", "default/trial0", timeout=60)
    assert reg.list("default", "trial0", include_dead=True).servers == []


@pytest.fixture
def fake_env(monkeypatch):
    monkeypatch.setenv("FAKE_REAL_PYTHON", sys.executable)


@pytest.mark.slurm
def test_on_slurm_a_killed_server_comes_back(slurm_env, areal_env, fake_env):
    _killed_server_comes_back("slurm", areal_env[1])


@pytest.mark.ray
def test_on_ray_a_killed_server_comes_back(ray_env, areal_env, fake_env):
    _killed_server_comes_back("ray", areal_env[1])
