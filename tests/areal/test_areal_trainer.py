"""AReaL's own trainer, unchanged, against servers `areal serve` started (marker `areal`).

AReaL 1.0.4 as its users install it (scripts/areal-venv.sh, `make areal`) runs a GRPO script
written on its public API (gsm8k_driver.py: PPOTrainer, FSDPEngine on gloo,
RemoteSGLangEngine, RLVRWorkflow, a reward function) on a tiny local model and a small
GSM8K-style dataset this test writes, through `areal train --areal-overrides`, with nothing
changed on the user's side: the config names another experiment, trial, name_resolve root
and rollout backend than ours, and the test exports nothing.

Each run checks: exit 0; the servers were found through AReaL's name_resolve (its own log
line); the server counted every weight update (hf's /server_info `weight_updates`, one per
step); after training, the server's greedy answers differ from the base model's; and after
`areal stop`, nothing AReaL wrote under the trial is left in the registry.

Skipped without the venv; AREAL_REQUIRE_AREAL=1 fails instead (tests/services.py).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest

from areal_cli.modelgen import create_tiny_model
from tests.areal.areal_venv import areal_python
from tests.helpers import AREAL
from tests.integration.helpers_server import request

pytestmark = [pytest.mark.areal, pytest.mark.timeout(1500)]

HERE = Path(__file__).parent
DRIVER = HERE / "gsm8k_driver.py"
STEPS = 2
EXPERIMENT, TRIAL = "gsm8k", "t0"
PROMPTS = ["Tom has 3 apples and buys 4 more.", "What is 5 + 2?", "Count to three:"]


def write_dataset(path: Path, n: int = 16) -> Path:
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        q = f"Tom has {a} apples and buys {b} more. How many apples does he have?"
        rows.append(json.dumps({"question": q, "answer": str(a + b)}))
    path.write_text("\n".join(rows) + "\n")
    return path


def write_config(tmp: Path, model: Path, data: Path, sync: str, world: int) -> Path:
    """A user's config, shrunk from AReaL's examples/math/gsm8k_grpo_cpu.yaml: its own
    experiment, trial, name_resolve root and rollout backend (vllm), all of which
    --areal-overrides replaces."""
    fileroot = tmp / "fileroot"
    cfg = f"""
experiment_name: users-own-name
trial_name: trial9
seed: 1
total_train_epochs: 1
total_train_steps: {STEPS}
tokenizer_path: ${{actor.path}}
cluster:
  n_nodes: 1
  n_gpus_per_node: 0
  fileroot: {fileroot}
  name_resolve:
    type: nfs
    nfs_record_root: {tmp / "users-own-name-resolve"}
rollout:
  backend: "vllm:d1p1t1"
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
  max_concurrent_rollouts: 4
  consumer_batch_size: ${{train_dataset.batch_size}}
  max_head_offpolicyness: 0
  setup_timeout: 120
  fileroot: ${{cluster.fileroot}}
  tokenizer_path: ${{tokenizer_path}}
gconfig:
  n_samples: 2
  max_new_tokens: 8
  greedy: false
  temperature: 1.0
actor:
  backend: "fsdp:d1p1t1"
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
  path: {model}
  init_from_scratch: false
  disable_dropout: true
  gradient_checkpointing: false
  dtype: float32
  attn_impl: sdpa
  mb_spec:
    max_tokens_per_mb: 1024
  optimizer:
    type: adam
    lr: 5.0e-2
    weight_decay: 0.0
    lr_scheduler_type: constant
    gradient_clipping: 1.0
    warmup_steps_proportion: 0.0
  eps_clip: 0.4
  temperature: ${{gconfig.temperature}}
  kl_ctl: 0.0
  ppo_n_minibatches: 1
  recompute_logprob: true
  use_decoupled_loss: true
  reward_norm:
    mean_level: group
    std_level: group
    group_size: ${{gconfig.n_samples}}
  adv_norm:
    mean_level: batch
    std_level: batch
  weight_update_mode: {sync}
  max_new_tokens: ${{gconfig.max_new_tokens}}
train_dataset:
  batch_size: {4 * world}
  shuffle: true
  pin_memory: false
  num_workers: 0
  path: {data}
  type: rl
  max_length: 256
saver:
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
  fileroot: ${{cluster.fileroot}}
  freq_epochs: null
  freq_steps: null
  freq_secs: null
recover:
  mode: disabled
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
  fileroot: ${{cluster.fileroot}}
evaluator:
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
  fileroot: ${{cluster.fileroot}}
  freq_epochs: null
stats_logger:
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
  fileroot: ${{cluster.fileroot}}
  wandb:
    mode: disabled
"""
    path = tmp / "gsm8k_grpo.yaml"
    path.write_text(cfg)
    return path


def run_areal(*args: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([AREAL, *args], capture_output=True, text=True, timeout=timeout, **kw)


def greedy_answers(url: str) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0.0}}
        status, got = request(f"{url}/generate", body, timeout=120)
        assert status == 200, got
        out.append(got["output_ids"])
    return out


def server_info(url: str) -> dict:
    status, got = request(f"{url}/server_info", timeout=30)
    assert status == 200, got
    return got


def trial_keys(registry: Path) -> list[str]:
    """Every key under the trial in the file registry (a folder holding ENTRY)."""
    base = registry / os.environ.get("USER", "root") / EXPERIMENT / TRIAL
    return sorted(str(p.parent.relative_to(base)) for p in base.rglob("ENTRY"))


def serve(backend: str, model: Path, python: str | None = None) -> str:
    args = ["serve", "--backend", backend, "--model", str(model), "--api-key", "none",
            "--experiment", EXPERIMENT, "--trial", TRIAL, "--detach", "--json"]  # fmt: skip
    if python:
        args += ["--python", python]
    res = run_areal(*args, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    server = out["servers"][0] if "servers" in out else out["processes"][0]
    return server.get("addr") or f"{server['host']}:{server['port']}"


def train(tmp: Path, cfg: Path, world: int, extra: tuple[str, ...] = ()):
    return run_areal(
        "train", "--alloc", f"fsdp:d{world}", "--experiment", EXPERIMENT, "--trial", TRIAL,
        "--python", areal_python(), "--areal-overrides", "--watchdog", "0",
        str(DRIVER), "--config", str(cfg), *extra, timeout=1200, cwd=tmp,
    )  # fmt: skip


@pytest.mark.parametrize(
    "world,sync", [(1, "disk"), (2, "disk"), (1, "xccl"), (2, "xccl")], ids=lambda v: str(v)
)
def test_areal_trainer_against_hf_servers(tmp_path, areal_env, world, sync):
    registry = areal_env[1]
    model = create_tiny_model(tmp_path / "tiny", seed=0)
    cfg = write_config(tmp_path, model, write_dataset(tmp_path / "gsm8k.jsonl"), sync, world)
    addr = serve("hf", model)
    url = f"http://{addr}"
    try:
        before = greedy_answers(url)
        res = train(tmp_path, cfg, world)
        log = res.stdout + res.stderr
        assert res.returncode == 0, log[-6000:]
        # AReaL found the servers in our registry with its own name_resolve (not the
        # AREAL_LLM_SERVER_ADDRS fallback), once per rank and per rollout engine.
        assert log.count("Get server addresses from name_resolve.") >= world, log[-4000:]
        assert "Get server addresses from environment variable." not in log
        assert f"Found 1 rollout servers: {addr}" in log
        info = server_info(url)
        assert info["weight_updates"] == STEPS, info
        if sync == "disk":
            assert str(tmp_path / "fileroot") in info["weights_path"]
            # AReaL's disk sync announced each version under our trial in our registry.
            assert [k for k in trial_keys(registry) if k.startswith("update_weights_from")]
        after = greedy_answers(url)
        assert after != before, "the served model answers as before training"
    finally:
        stop = run_areal("stop", f"{EXPERIMENT}/{TRIAL}", timeout=120)
    assert stop.returncode == 0, stop.stderr
    # Nothing of the trial is left: our entries and AReaL's keys went with the stop.
    assert trial_keys(registry) == []


def test_areal_disk_sync_against_real_sglang(tmp_path, areal_env):
    """The real SGLang 0.5.23 CPU engine (make engines): AReaL's disk sync loads each
    version through /update_weights_from_disk."""
    from tests.engines.engines import missing, python_of

    why = missing("sglang")
    if why:
        if os.environ.get("AREAL_REQUIRE_ENGINES") == "1":
            pytest.fail(f"{why}, and AREAL_REQUIRE_ENGINES=1", pytrace=False)
        pytest.skip(why)
    registry = areal_env[1]
    model = create_tiny_model(tmp_path / "tiny", seed=0)
    cfg = write_config(tmp_path, model, write_dataset(tmp_path / "gsm8k.jsonl"), "disk", 1)
    addr = serve("sglang", model, str(python_of("sglang")))
    url = f"http://{addr}"
    try:
        # AReaL's process-group sync speaks the SGLang it pins (0.5.10.post1), which 0.5.23
        # refuses (no begin/end session): refused before any rank starts, the ways out named.
        xccl = train(tmp_path, cfg, 1, ("actor.weight_update_mode=xccl",))
        assert xccl.returncode == 2, xccl.stderr[-3000:]
        assert f"{addr} serves SGLang 0.5.23" in xccl.stderr, xccl.stderr
        assert (
            "actor.weight_update_mode=disk" in xccl.stderr and "started torchrun" not in xccl.stderr
        )
        doctor = run_areal("doctor", "check", "--python", areal_python(), "--json", timeout=300)
        rows = {r["name"]: r for r in json.loads(doctor.stdout)["rows"]}
        served = rows["served sglang"]
        assert served["status"] == "warn" and "run SGLang 0.5.23" in served["detail"], rows
        assert "pins SGLang 0.5.10.post1" in served["detail"]
        before = greedy_answers(url)
        res = train(tmp_path, cfg, 1)
        log = res.stdout + res.stderr
        assert res.returncode == 0, log[-6000:]
        assert "Get server addresses from name_resolve." in log
        # Every version was loaded: AReaL said so once per step, and the engine serves the
        # last one AReaL wrote (SGLang takes the new path as its model_path).
        assert log.count("Loading weights from disk done") == STEPS, log[-4000:]
        status, info = request(f"{url}/model_info", timeout=30)
        assert status == 200, info
        assert info["model_path"].startswith(str(tmp_path / "fileroot")), info
        assert info["model_path"].endswith(f"weight_update_v{STEPS}"), info
        after = greedy_answers(url)
        assert after != before, "the served model answers as before training"
    finally:
        stop = run_areal("stop", f"{EXPERIMENT}/{TRIAL}", timeout=180)
    assert stop.returncode == 0, stop.stderr
    assert trial_keys(registry) == []
