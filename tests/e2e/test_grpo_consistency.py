"""The GRPO example's `check_every`: its ranks compare what they should agree on while they
train (two FSDP ranks against a real hf server), and `areal doctor diverge --job` asks the same
job over the doctor channel while it runs."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from areal_cli import procs
from tests.helpers import AREAL, REPO, areal

TRAIN = str(REPO / "templates" / "grpo" / "train.py")
CONFIG = str(REPO / "templates" / "grpo" / "tiny_cpu.yaml")
# Enough steps that the doctor, started once metrics appear, still finds the job stepping
# on a loaded machine (it asks for a step about a second ahead).
STEPS = 24


def test_check_every_and_doctor_diverge_on_a_training_job(tmp_path, areal_env):
    from areal_cli.modelgen import create_tiny_model

    home, _ = areal_env
    tiny = create_tiny_model(tmp_path / "tiny", seed=0)
    areal("serve", "--backend", "hf", "--model", str(tiny), "--detach", check=0, timeout=180)
    logs = Path(home) / "logs" / os.environ.get("USER", "root") / "default" / "trial0"
    out = tmp_path / "train.out"
    with open(out, "wb") as f:
        train = subprocess.Popen(
            [AREAL, "train", "--alloc", "fsdp:d2", TRAIN, "--config", CONFIG,
             f"steps={STEPS}", "check_every=2"],
            stdout=f, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        metrics = logs / "metrics.jsonl"
        assert procs.wait_until(lambda: metrics.exists() and metrics.stat().st_size, 180)
        res = areal("doctor", "diverge", "--job", "default/trial0", "--json", timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        data = json.loads(res.stdout)
        # FSDP shards the parameters and Adam's moments; the rotary buffers and the
        # optimizer's steps are replicated across dp and agree.
        assert data["ok"] and data["ranks"] == [0, 1] and data["checked"] > 0
        assert data["skipped"] > 0 and 0 < data["step"] < STEPS
        assert train.wait(timeout=300) == 0, out.read_text()[-3000:]
    finally:
        areal("stop", "default/trial0", check=0)
        if train.poll() is None:
            train.kill()
            train.wait()
    lines = [x for x in out.read_text().splitlines() if "consistency at step" in x]
    assert len(lines) == STEPS // 2 and all("ranks agree" in x for x in lines), lines
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    assert [r["consistent"] for r in rows] == [True, None] * (STEPS // 2)
