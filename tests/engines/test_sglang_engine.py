"""Real SGLang 0.5.23 (its CPU engine) under `areal serve`: what the client and the weight
sync do against the hf stand-in, they do against the engine.

One server for the module (`areal serve --detach --python <venv>`, an API key as by
default); the last test stops it with `areal stop` and checks that nothing is left. Paths
in comments are relative to the sglang package of the engine's venv.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_cli.modelgen import create_tiny_model
from tests.engines.engines import EngineServer, transformers_logprobs

pytestmark = pytest.mark.engines

HERE = Path(__file__).resolve().parent
PROMPT = [72, 101, 108, 108, 111]


@pytest.fixture(scope="module")
def others(tmp_path_factory) -> list[Path]:
    """Same shape, other weights: what the trainer sends."""
    root = tmp_path_factory.mktemp("others")
    return [create_tiny_model(root / f"seed{i}", seed=i) for i in (1, 2)]


def trainer(srv: EngineServer, model: Path, method: str, version: str, tmp: Path, shift=0.0,
            syncs=1):  # fmt: skip
    cmd = [sys.executable, str(HERE / "engine_trainer.py"), "--model", str(model),
           "--server", srv.addr, "--backend", "sglang", "--method", method,
           "--version", version, "--weights-dir", str(tmp), "--shift", str(shift),
           "--syncs", str(syncs)]  # fmt: skip
    env = {**os.environ, "ENGINE_KEY": srv.key or "", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def greedy(srv: EngineServer) -> list[int]:
    status, body = srv.post("/generate", {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0}})  # fmt: skip
    assert status == 200, body
    return body["output_ids"]


def test_served_by_its_cpu_engine_and_ready_only_after_a_first_generation(sglang):
    log = sglang.log()
    # srt/utils/common.py:221-224: the CPU engine, chosen by SGLANG_USE_CPU_ENGINE=1.
    assert "'device': 'cpu'" in log and "'attention_backend': 'torch_native'" in log
    # Readiness: SGLang's own warm-up generation answered (srt/entrypoints/http_server.py:
    # 2490-2502) turns its /ready to 200, and the runner registers the server then: no
    # generation of its own, and no /health (a second and more) before it.
    before = log[: log.index("[replica]")]
    ready = before.index('"GET /ready HTTP/1.1" 200')
    assert before.count("POST /generate") == 1
    assert '"POST /generate HTTP/1.1" 200' in before[:ready]
    assert "GET /health" not in before and "registered" in log[ready:]
    print(f"\nsglang: areal serve ready in {sglang.seconds_to_ready:.1f} s")


def test_the_api_key_guards_all_but_the_probes(sglang):
    # srt/utils/auth.py:96-103 (health, ready, metrics open), :192-203 (401 otherwise).
    assert sglang.get("/model_info", headers={"Authorization": "Bearer wrong"})[0] == 401
    assert sglang.get("/health", headers={"Authorization": ""})[0] == 200
    assert sglang.get("/model_info")[0] == 200


def test_logprobs_match_transformers_on_the_same_weights(sglang, model):
    from areal_cli.worker.rollout import RolloutClient

    async def main():
        async with RolloutClient([sglang.addr], backend="sglang", api_key=sglang.key) as c:
            return await c.generate(PROMPT, max_new_tokens=8, temperature=1.0, seed=3)

    out = asyncio.run(asyncio.wait_for(main(), 120))
    assert len(out.output_ids) == 8 and out.weight_version == "default"
    want = transformers_logprobs(model, PROMPT, out.output_ids)
    # float32 on both sides (--dtype float32): the same numbers up to summation order.
    assert out.logprobs == pytest.approx(want, abs=1e-4)


def test_disk_sync_moves_weights_and_version(sglang, others, tmp_path):
    line = trainer(sglang, others[0], "disk", "d1", tmp_path)
    assert line["ok"], line
    # srt/managers/tokenizer_manager.py:2313-2318: the version given with the update.
    assert sglang.get("/model_info")[1]["weight_version"] == "d1"
    assert greedy(sglang) == line["expected"]


def test_distributed_sync_over_gloo_moves_weights_and_version(sglang, model, others, tmp_path):
    # srt/entrypoints/http_server.py init_weights_update_group / update_weights_from_distributed:
    # on CPU the group is gloo; the trainer broadcasts each tensor.
    line = trainer(sglang, others[1], "distributed", "g1", tmp_path)
    assert line["ok"], line
    assert sglang.get("/model_info")[1]["weight_version"] == "g1"
    assert greedy(sglang) == line["expected"]
    again = trainer(sglang, model, "distributed", "g2", tmp_path, shift=0.01)
    assert again["ok"] and greedy(sglang) == again["expected"] != line["expected"], again


def test_a_reused_weight_group_costs_five_requests_a_sync(sglang, model, tmp_path):
    # Each SGLang control request costs milliseconds on a CPU (its tokenizer manager, then
    # its scheduler), so a sync asks no more than it must. 0.5.23 loads a distributed
    # update only inside a session (srt/managers/scheduler_components/weight_updater.py:
    # 192-197, begin/end :309-335), and a begin waits for running generations unless the
    # engine is paused (managers/tokenizer_control_mixin.py:471-483): pause, begin,
    # update, end, continue. The group is made once per trainer, /server_info (a round
    # trip to the scheduler, entrypoints/http_server.py:863-892) asked once, and the tiny
    # model's tensors go as one flattened_bucket: one update per sync
    # (model_runner_components/weight_updater.py:260-310).
    start = len(sglang.log())
    line = trainer(sglang, model, "distributed", "r3", tmp_path, shift=0.02, syncs=3)
    assert line["ok"] and line["version"] == "r3", line
    assert sglang.get("/model_info")[1]["weight_version"] == "r3"
    assert greedy(sglang) == line["expected"]
    log = sglang.log()[start:]

    def answered(route: str) -> int:
        return log.count(f'{route} HTTP/1.1" 200')

    assert answered("GET /server_info") == 1 and answered("POST /init_weights_update_group") == 1
    for route in ("/pause_generation", "/begin_weight_update", "/update_weights_from_distributed",
                  "/end_weight_update", "/continue_generation"):  # fmt: skip
        assert answered(f"POST {route}") == 3, (route, log[-3000:])
    assert answered("POST /destroy_weights_update_group") == 1  # the trainer's exit


def test_ps_logs_and_stop_leave_nothing(sglang):
    ps = sglang.areal("ps", "--json")
    assert ps.returncode == 0, ps.stderr
    (job,) = [j for j in json.loads(ps.stdout) if j["name"] == sglang.name]
    # SGLang's /health answers after 1 s (srt/entrypoints/http_server.py:777-779): ps waits.
    assert [(s["addr"], s["healthy"]) for s in job["servers"]] == [(sglang.addr, True)], job
    logs = sglang.areal("logs", sglang.name, "--role", "server", "--lines", "100000")
    assert logs.returncode == 0 and "[server-0]" in logs.stdout
    assert "The server is fired up and ready to roll!" in logs.stdout
    assert sglang.processes()
    stop = sglang.stop()
    assert stop.returncode == 0, stop.stderr
    assert sglang.processes() == []
    assert "stopped" in stop.stdout + stop.stderr
