"""The GRPO example survives a dead rank: it saves checkpoints as it goes, and the same
command started again resumes from the latest one, with the servers brought back to that
checkpoint's weights before the first rollout and the metrics going on from its step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request
from pathlib import Path

import psutil
import pytest

from areal_cli import apikeys
from tests.helpers import AREAL, REPO, areal, wait_for

TRAIN = str(REPO / "templates" / "grpo" / "train.py")
CONFIG = str(REPO / "templates" / "grpo" / "tiny_cpu.yaml")
JOB = ("default", "trial0")


def _logs(home: Path) -> Path:
    return home / "logs" / os.environ.get("USER", "root") / JOB[0] / JOB[1]


def _metrics(home: Path) -> list[dict]:
    path = _logs(home) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _http(home: Path, addr: str, path: str, body: dict | None = None) -> dict:
    key = json.loads(apikeys.key_file(home, *JOB).read_text())["key"]
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{addr}{path}", data=data)
    req.add_header("Authorization", f"Bearer {key}")  # a key on loopback too
    if data is not None:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _train(*overrides: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [AREAL, "train", "--alloc", "fsdp:d2", TRAIN, "--config", CONFIG, *overrides],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw,
    )  # fmt: skip


def _rank_pid(proc: subprocess.Popen, rank: int) -> int | None:
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            env = p.environ()
        except psutil.Error:
            continue
        if env.get("RANK") == str(rank) and "LOCAL_RANK" in env:
            return p.pid
    return None


def _served_and_expected(home: Path, addr: str, weights: dict) -> tuple[list, list]:
    """The server's logprobs of a sampled continuation, and those `weights` give them."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = [104, 101, 108, 108, 111]
    out = _http(home, addr, "/generate", {
        "input_ids": prompt, "return_logprob": True,
        "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 1},
    })  # fmt: skip
    served = [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]
    model = AutoModelForCausalLM.from_pretrained(weights["base"], dtype=torch.float32)
    if weights.get("state") is not None:
        model.load_state_dict(weights["state"])
    ids = torch.tensor([prompt + out["output_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    return served, [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(out["output_ids"])]


def _checkpoint_state(tiny: Path, path: Path) -> dict:
    """The model weights of a checkpoint, read whole with DCP in this one process."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    sd = {"model": AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).state_dict()}
    dcp.load(sd, checkpoint_id=str(path))
    return sd["model"]


@pytest.fixture
def tiny(tmp_path):
    from areal_cli.modelgen import create_tiny_model

    return create_tiny_model(tmp_path / "tiny", seed=0)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_rank_killed_mid_run_resumes_from_its_checkpoint_on_realigned_servers(tiny, areal_env):
    from areal_cli.worker.checkpoint import latest

    home, _ = areal_env
    out = areal("serve", "--backend", "hf", "--model", str(tiny), "--detach", "--json",
                check=0, timeout=180)  # fmt: skip
    (server,) = json.loads(out.stdout)["servers"]
    addr = server["addr"]
    ckdir = _logs(home) / "checkpoints"
    run = _train("steps=40", "save_every=2")
    try:
        # Killed once a checkpoint exists and the run has gone on past it, so the servers hold
        # weights newer than any checkpoint.
        def past_a_checkpoint() -> bool:
            assert run.poll() is None, run.communicate()[0][-4000:]
            got = latest(ckdir)
            return got is not None and got.step >= 2 and len(_metrics(home)) > got.step

        wait_for(past_a_checkpoint, 400, "no checkpoint with a step after it", interval=0.2)
        os.kill(wait_for(lambda: _rank_pid(run, 1), 30, "no rank 1"), signal.SIGKILL)
        output, _ = run.communicate(timeout=180)
        assert run.returncode == 1, output[-4000:]  # the job died with its rank
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    saved = latest(ckdir)
    step = saved.step
    rows = _metrics(home)
    held = int(_http(home, addr, "/model_info")["weight_version"])
    assert len(rows) > step and held > step, (len(rows), held, step)

    try:
        # Started again with nothing left to do at that step: it resumes, brings the server
        # back to the checkpoint's weights, and ends; the server says so over HTTP.
        again = _train(f"steps={step}")
        output, _ = again.communicate(timeout=600)
        assert again.returncode == 0, output[-4000:]
        assert f"resumed from {saved.path} at step {step}" in output
        info = _http(home, addr, "/model_info")
        # A version past every one the servers held: a label never names two sets of weights.
        assert info["weight_version"] == str(held + 1)
        state = _checkpoint_state(tiny, saved.path)
        served, expected = _served_and_expected(home, addr, {"base": tiny, "state": state})
        assert served == pytest.approx(expected, abs=1e-4)
        # ... which the base weights do not give: the comparison tells weights apart.
        served, base = _served_and_expected(home, addr, {"base": tiny})
        assert max(abs(a - b) for a, b in zip(served, base, strict=True)) > 1e-3

        # Started again with more steps: the curve goes on from the checkpoint's step, each
        # step once, and the first rollout sampled the checkpoint's weights (the trainer's
        # and the server's logprobs of the same tokens agree).
        more = _train(f"steps={step + 2}")
        output, _ = more.communicate(timeout=600)
        assert more.returncode == 0, output[-4000:]
    finally:
        areal("stop", "/".join(JOB), check=0, timeout=60)
    rows = _metrics(home)
    assert [r["step"] for r in rows] == list(range(step + 2)), [r["step"] for r in rows]
    resumed = rows[step:]
    assert [r["weight_version"] for r in resumed] == [str(held + 3), str(held + 4)]
    assert max(r["logprob_gap"] for r in resumed) < 1e-3
    assert latest(ckdir).step == step + 2  # the last step is saved whole before the end
