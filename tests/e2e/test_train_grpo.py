"""The product's main path, as a user types it: `areal serve` in one command, `areal train`
of the GRPO example in another; then the failure cases of servers dying mid-training."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from areal_cli import apikeys
from tests.helpers import AREAL, REPO, areal

TRAIN = str(REPO / "templates" / "grpo" / "train.py")
CONFIG = str(REPO / "templates" / "grpo" / "tiny_cpu.yaml")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from areal_cli.modelgen import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=0)


def metrics(home: Path) -> list[dict]:
    path = home / "logs" / os.environ.get("USER", "root") / "default" / "trial0" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def serve(tiny, *extra):
    out = areal("serve", "--backend", "hf", "--model", str(tiny), "--detach", "--json", *extra,
                check=0, timeout=180)  # fmt: skip
    return json.loads(out.stdout)["servers"]


# The reward of the toy task rises from about 0.02 to above 0.9 within 12 steps (the demo
# runs 25), with either way of syncing the weights.
@pytest.mark.parametrize("method", ["distributed", "disk"])
def test_serve_then_train_learns_through_weight_sync(tiny, areal_env, method):
    steps = 12
    home, _ = areal_env
    (server,) = serve(tiny)
    try:
        res = areal("train", "--alloc", "fsdp:d2", TRAIN, "--config", CONFIG,
                    f"sync_method={method}", f"steps={steps}", check=0, timeout=400)  # fmt: skip
        assert "training finished with exit code 0" in res.stderr
        # The header is one line, the server list included.
        header = next(x for x in (res.stdout + res.stderr).splitlines() if "GRPO" in x)
        assert f"sync {method}" in header and f"servers {server['addr']}" in header
        # Fresh servers hold the checkpoint the trainer loads: said, and nothing pushed.
        assert "servers hold the weights the trainer starts from" in res.stdout + res.stderr
        rows = metrics(home)
        assert [r["step"] for r in rows] == list(range(steps))
        rewards = [r["reward_mean"] for r in rows]
        assert all(0.0 <= x <= 1.0 for x in rewards)
        gain = sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5
        assert gain >= 0.2, rewards
        # The new weights really reached the server: its version is the last step's.
        key = json.loads(apikeys.key_file(home, "default", "trial0").read_text())["key"]
        req = urllib.request.Request(f"http://{server['addr']}/model_info")
        req.add_header("Authorization", f"Bearer {key}")  # a key on loopback too
        with urllib.request.urlopen(req) as r:
            version = json.loads(r.read())["weight_version"]
        assert version == rows[-1]["weight_version"] == str(steps)
        assert max(r["logprob_gap"] for r in rows) < 1e-3
    finally:
        areal("stop", "default/trial0", check=0)


def _train_in_background(steps: int) -> subprocess.Popen:
    # One rank: what is tested here is the servers' side (the seed flow above has two).
    return subprocess.Popen(
        [AREAL, "train", "--alloc", "fsdp:d1", TRAIN, "--config", CONFIG, f"steps={steps}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _wait_steps(home, n, proc, timeout=240):
    deadline = time.monotonic() + timeout
    while len(metrics(home)) < n:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "training made no progress"
        time.sleep(0.2)


def test_a_server_killed_mid_training_costs_no_step(tiny, areal_env):
    home, _ = areal_env
    servers = serve(tiny, "--alloc", "hf:d2")
    proc = _train_in_background(steps=6)
    try:
        _wait_steps(home, 2, proc)
        psutil.Process(servers[0]["pid"]).kill()
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        assert [r["step"] for r in metrics(home)] == list(range(6))
    finally:
        proc.kill()
        areal("stop", "default/trial0", check=0)


def test_the_last_server_dying_is_a_clear_failure(tiny, areal_env):
    home, _ = areal_env
    (server,) = serve(tiny, "--max-restarts", "0")  # dead for good
    proc = _train_in_background(steps=200)
    try:
        _wait_steps(home, 2, proc)
        psutil.Process(server["pid"]).kill()
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 1
        assert "no inference server left" in err and "rank-" in err
    finally:
        proc.kill()
        areal("stop", "default/trial0", check=0)
