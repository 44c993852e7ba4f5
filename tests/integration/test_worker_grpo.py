"""The GRPO template end to end: 2 torchrun ranks on CPU learn the toy task from a real hf server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from helpers_server import HfServer

from areal_cli.modelgen import create_tiny_model

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "templates" / "grpo"
STEPS = 15

pytestmark = pytest.mark.slow


def test_grpo_template_learns_the_toy_task_through_weight_sync(tmp_path):
    model = create_tiny_model(tmp_path / "tiny", seed=0)
    log_dir = tmp_path / "logs"
    env = {
        **os.environ,
        "AREAL_ALLOC": "fsdp:d2",
        "AREAL_SERVER_BACKEND": "hf",
        "AREAL_LOG_DIR": str(log_dir),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    with HfServer(model, tmp_path, "--seed", "0") as server:
        server.wait_healthy()
        env["AREAL_LLM_SERVER_ADDRS"] = f"127.0.0.1:{server.port}"
        argv = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", "2", str(TEMPLATE / "train.py"),
            "--config", str(TEMPLATE / "tiny_cpu.yaml"), f"steps={STEPS}",
        ]  # fmt: skip
        proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, text=True,
        )  # fmt: skip
        try:
            output, _ = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:
                for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(True)]:
                    p.kill()
                proc.wait(10)
        assert proc.returncode == 0, output[-4000:]
        status, body = server.get("/get_weight_version")

    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    for key in ("reward_mean", "weight_version", "step_time_s", "tokens_per_s"):
        assert all(key in r for r in rows), key
    assert [r["weight_version"] for r in rows] == [str(s + 1) for s in range(STEPS)]
    assert status == 200 and body["weight_version"] == str(STEPS)
    rewards = [r["reward_mean"] for r in rows]
    assert all(0.0 <= x <= 1.0 for x in rewards)
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last - first >= 0.2, rewards
    # The trainer's logprobs match the server's: the servers hold the trainer's weights.
    assert max(r["logprob_gap"] for r in rows) < 1e-3
    assert "reward_mean" in output and "weight_version" in output  # the table header
