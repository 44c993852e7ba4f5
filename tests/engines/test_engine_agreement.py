"""Against the real engines: a restarted trainer aligns the servers before its first rollout,
the API key is checked before any rank starts, `areal key` hands it out, `doctor check`
reports the engines of the servers' venvs, and the client speaks vLLM 0.32 (the CPU build).

One server per engine for the module. Paths in comments are relative to the engine's
package in its venv (scripts/engines.sh).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engines.engines import EngineServer, python_of

pytestmark = pytest.mark.engines

REPO = Path(__file__).resolve().parents[2]
TRAINER = str(REPO / "tests" / "fixtures" / "scripts" / "restart_trainer.py")
RECORD = str(REPO / "tests" / "fixtures" / "scripts" / "record_env.py")


def restart(srv: EngineServer, model: Path, mode: str, method: str, weights: Path) -> dict:
    env = {**os.environ, "AREAL_LLM_SERVER_ADDRS": srv.addr, "AREAL_SERVER_BACKEND": srv.engine,
           "AREAL_API_KEY": srv.key or "", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    res = subprocess.run([sys.executable, TRAINER, "--model", str(model), "--mode", mode,
                          "--method", method, "--weights-dir", str(weights)],
                         capture_output=True, text=True, timeout=400, env=env)  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def aligned_after_an_earlier_run(srv, model, tmp_path, earlier: str, method: str) -> None:
    first = restart(srv, model, "earlier", earlier, tmp_path / "w1")
    assert first["synced"] is False and first["versions"] == {srv.addr: "default"}, first
    assert first["before"] < 1e-3, first  # fresh servers sample from the trainer's weights
    again = restart(srv, model, "restart", method, tmp_path / "w2")
    assert again["before"] > 0.1, again  # version 12 of the earlier run
    assert again["synced"] is True and again["after"] < 1e-3, again
    assert f"{srv.addr} holds weight version 12" in again["line"]
    assert again["versions"] == {srv.addr: "0"}
    print(f"\n{srv.engine}: logprob gap before {again['before']:.3f}, after {again['after']:.2g}")


def test_sglang_restart_gets_the_trainers_weights_before_the_first_rollout(sglang, model, tmp_path):
    # The earlier run syncs over gloo; the restart by disk, after which SGLang's
    # /model_info names the checkpoint it loaded (managers/tokenizer_manager.py:2365-2369).
    aligned_after_an_earlier_run(sglang, model, tmp_path, "distributed", "disk")
    assert sglang.get("/model_info")[1]["model_path"].startswith(str(tmp_path / "w2"))


def test_sglang_key_checked_before_any_rank_and_handed_out_by_areal_key(
    sglang, tmp_path, monkeypatch
):
    monkeypatch.delenv("AREAL_API_KEY", raising=False)
    key = sglang.areal("key", sglang.name).stdout.strip()
    assert key == sglang.key
    record = tmp_path / "rec"
    record.mkdir()
    monkeypatch.setenv("RECORD_DIR", str(record))
    res = sglang.areal("train", "--alloc", "fsdp:d1", "--servers", sglang.addr, RECORD)
    # srt/utils/auth.py:96-106: /health is open, /model_info wants the key.
    assert res.returncode == 2, res.stderr
    assert f"{sglang.addr} (HTTP 401): want an API key" in res.stderr
    monkeypatch.setenv("AREAL_API_KEY", "wrong")
    res = sglang.areal("train", "--alloc", "fsdp:d1", "--servers", sglang.addr, RECORD)
    assert res.returncode == 2 and "refuse the key given" in res.stderr, res.stderr
    monkeypatch.delenv("AREAL_API_KEY")
    res = sglang.areal("train", "--alloc", "fsdp:d1", "--experiment", sglang.experiment,
                       "--trial", sglang.trial, "--areal-overrides", RECORD)  # fmt: skip
    assert res.returncode == 2 and "AReaL's trainer sends none" in res.stderr, res.stderr
    assert not list(record.iterdir())  # no rank ran


def test_doctor_check_reports_sglang_of_the_servers_venv(sglang):
    res = sglang.areal("doctor", "check", "--json", timeout=180)
    rows = {r["name"]: r for r in json.loads(res.stdout)["rows"]}
    assert f"0.5.23 from {python_of('sglang')}" in rows["sglang"]["detail"], rows["sglang"]
    assert "SGLang" in rows["server API keys"]["detail"]


def test_vllm_032_spoken_as_such_and_asked_once_what_it_serves(vllm):
    import asyncio

    from areal_cli.worker.rollout import RolloutClient

    async def main():
        async with RolloutClient([vllm.addr], backend="vllm", api_key=vllm.key) as client:
            groups = await client.generate_batch([[72, 101]], n=64, max_new_tokens=2)
            return groups, await client.engine_versions()

    before = vllm.log().count("GET /v1/models")
    groups, versions = asyncio.run(main())
    # serve/instrumentator/basic.py:53-56
    assert versions == {vllm.addr: "0.32"}
    assert len(groups[0]) == 64 and all(c.weight_versions is None for c in groups[0])
    assert vllm.log().count("GET /v1/models") - before == 1


def test_vllm_key_checked_before_any_rank(vllm, monkeypatch):
    # vLLM guards /v1 and three other prefixes, not /health (serve/middleware/
    # authenticate.py:11, :59); --servers tells no backend: /model_info 404s, /v1/models 401s.
    monkeypatch.delenv("AREAL_API_KEY", raising=False)
    res = vllm.areal("train", "--alloc", "fsdp:d1", "--servers", vllm.addr, RECORD)
    assert res.returncode == 2, res.stderr
    assert f"{vllm.addr} (HTTP 401): want an API key" in res.stderr


def test_vllm_restart_gets_the_trainers_weights_before_the_first_rollout(vllm, model, tmp_path):
    # vLLM 0.32's weight transfer needs CUDA: disk both times (reload_weights through
    # /collective_rpc, the version from /weight_info).
    aligned_after_an_earlier_run(vllm, model, tmp_path, "disk", "disk")
