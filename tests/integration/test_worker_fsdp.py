"""The worker runtime under torchrun: 2 CPU ranks over gloo, a tiny model, a real hf server.

One torchrun job (module fixture) does everything a training step does: connect(), shard the
model with FSDP2, one optimizer step on each rank's half of a batch, save an HF checkpoint,
then sync the weights into a running hf server. The tests check each result against an
unsharded reference computed here in the test process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from helpers_server import HfServer

from areal_cli.modelgen import create_tiny_model

LR = 1e-3
BATCH_SEED = 1234

WORKER = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    from areal_cli.worker import connect, save_hf_checkpoint, shard_model, sync_weights

    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    ctx = connect()
    assert connect() is ctx  # idempotent
    info = {
        "rank": ctx.rank, "world_size": ctx.world_size, "local_rank": ctx.local_rank,
        "device": str(ctx.device), "mesh_dims": list(ctx.mesh.mesh_dim_names),
        "mesh_shape": list(ctx.mesh.shape), "dp_rank": ctx.dp_rank, "dp_size": ctx.dp_size,
        "backend": ctx.backend, "servers": ctx.servers, "log_dir": str(ctx.log_dir),
        "experiment": ctx.experiment, "trial": ctx.trial,
        "pg_backend": torch.distributed.get_backend(),
    }

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    shard_model(model, ctx.mesh)
    info["sharded_blocks"] = sum(
        type(b).__name__.startswith("FSDP") for b in model.model.layers
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(os.environ["TEST_LR"]))
    gen = torch.Generator().manual_seed(int(os.environ["TEST_BATCH_SEED"]))
    batch = torch.randint(0, 256, (4, 12), generator=gen)
    mine = batch[2 * ctx.rank : 2 * ctx.rank + 2]
    loss = model(input_ids=mine, labels=mine).loss
    loss.backward()
    optimizer.step()
    info["loss"] = loss.item()

    save_hf_checkpoint(model, out / "ckpt", tokenizer_from=model_dir)

    if ctx.servers:
        client = ctx.rollout_client()
        synced = sync_weights(model, client, out / "synced", version="step-1", tokenizer_from=model_dir)
        info["synced_version"] = synced["version"]
        if ctx.is_main:
            info["server_versions"] = client.run(client.weight_versions())
        client.close_sync()

    (out / f"rank{ctx.rank}.json").write_text(json.dumps(info))
    ctx.close()
    """
)


def _kill_tree(proc: subprocess.Popen, tree: list[psutil.Process]) -> None:
    try:
        tree = tree + psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for p in tree:
        try:
            p.kill()
        except psutil.Error:
            pass
    proc.wait(10)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = HfServer(model_dir, tmp_path_factory.mktemp("srvlogs"), "--seed", "0")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def job(model_dir, server, tmp_path_factory):
    """Run the worker under torchrun once; the per-rank results and the output folder."""
    out = tmp_path_factory.mktemp("job")
    script = out / "worker.py"
    script.write_text(WORKER)
    env = {
        **os.environ,
        "AREAL_ALLOC": "hf:d1+fsdp:d2",
        "AREAL_LLM_SERVER_ADDRS": f"127.0.0.1:{server.port}",
        "AREAL_SERVER_BACKEND": "hf",
        "AREAL_LOG_DIR": str(out / "logs"),
        "AREAL_EXPERIMENT": "exp",
        "AREAL_TRIAL": "t1",
        "TEST_LR": str(LR),
        "TEST_BATCH_SEED": str(BATCH_SEED),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", "2", str(script), str(model_dir), str(out),
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )
    tree: list[psutil.Process] = []
    try:
        try:
            output, _ = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            tree = psutil.Process(proc.pid).children(recursive=True)
            _kill_tree(proc, tree)
            output, _ = proc.communicate()
            pytest.fail(f"torchrun job did not finish in 180 s:\n{output[-3000:]}")
        assert proc.returncode == 0, output
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
        yield {"ranks": ranks, "out": out, "output": output}
    finally:
        if proc.poll() is None:
            _kill_tree(proc, tree)


def _reference_state(model_dir: Path):
    """The same step unsharded, in this process: full-batch loss, one AdamW step."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    batch = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(BATCH_SEED))
    # Both ranks hold the same number of tokens, so the mean of their means is this mean.
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    return model


def test_connect_builds_the_mesh_from_the_allocation(job):
    for rank, info in enumerate(job["ranks"]):
        assert info["rank"] == rank == info["local_rank"] == info["dp_rank"]
        assert info["world_size"] == 2 and info["dp_size"] == 2
        assert info["device"] == "cpu" and info["pg_backend"] == "gloo"
        assert info["mesh_dims"] == ["dp"] and info["mesh_shape"] == [2]
        assert info["backend"] == "hf" and len(info["servers"]) == 1
        assert (info["experiment"], info["trial"]) == ("exp", "t1")
        assert info["sharded_blocks"] == 2


def test_checkpoint_from_sharded_model_equals_unsharded_step(job, model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = job["out"] / "ckpt"
    loaded = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    reference = _reference_state(model_dir)
    ref_state = reference.state_dict()
    got_state = loaded.state_dict()
    assert set(got_state) == set(ref_state)
    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    moved = 0
    for name, ref in ref_state.items():
        torch.testing.assert_close(got_state[name], ref, rtol=0, atol=2e-6, msg=name)
        moved += not torch.equal(ref, original[name])
    assert moved > len(ref_state) // 2  # the step really changed the weights
    # The tokenizer travelled with the weights, so the folder is servable on its own.
    assert AutoTokenizer.from_pretrained(ckpt).encode("hi") == [104, 105]
    assert not list(ckpt.parent.glob(".ckpt.tmp-*"))


def test_sync_weights_reaches_the_running_server(job, server):
    import torch
    from transformers import AutoModelForCausalLM

    assert [info["synced_version"] for info in job["ranks"]] == ["step-1", "step-1"]
    assert job["ranks"][0]["server_versions"] == {f"127.0.0.1:{server.port}": "step-1"}
    status, body = server.get("/model_info")
    assert status == 200 and body["weight_version"] == "step-1"

    # The server now samples from the trained weights: its logprobs for a greedy
    # continuation are the ones the synced checkpoint gives here.
    prompt = [104, 101, 108, 108, 111]
    status, out = server.post(
        "/generate",
        {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0},
            "return_logprob": True,
        },
    )
    assert status == 200, out
    served = [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]
    model = AutoModelForCausalLM.from_pretrained(job["out"] / "synced", dtype=torch.float32)
    ids = torch.tensor([prompt + out["output_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    expected = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(out["output_ids"])]
    assert served == pytest.approx(expected, abs=1e-4)
