"""A server that refuses every request is seen: a real hf server under `areal serve`, a real
trainer under `areal train` that gets a 400 on every request and retries forever (as AReaL's
did), and `areal ps`, the watchdog and `doctor hang` naming the server and its message.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from areal_cli.modelgen import create_tiny_model
from tests.helpers import AREAL, REPO, areal, wait_for

SCRIPT = str(REPO / "tests" / "fixtures" / "scripts" / "refused_trainer.py")
REFUSAL = "the hf server does not support image_data"
ENV = {"AREAL_REGISTRY_TTL": "3"}  # renewed every second: the counts reach the registry soon


@pytest.fixture
def served(tmp_path):
    model = create_tiny_model(tmp_path / "model", seed=0)
    out = areal("serve", "--backend", "hf", "--model", str(model), "--detach", "--json",
                env=ENV, check=0, timeout=180)  # fmt: skip
    (server,) = json.loads(out.stdout)["servers"]
    yield server["addr"]
    areal("stop", "default/trial0", "--kind", "serve", check=0, timeout=60)


def _job(kind: str) -> dict | None:
    jobs = json.loads(areal("ps", "--json", check=0).stdout)
    return next((j for j in jobs if j["kind"] == kind), None)


def _errors(addr: str) -> dict | None:
    job = _job("serve")
    servers = [s for s in (job or {}).get("servers", []) if s["addr"] == addr]
    return servers[0].get("errors") if servers else None


def test_a_trainer_refused_every_request_is_named_by_ps_the_watchdog_and_doctor_hang(
    served, areal_env
):
    home = areal_env[0]
    trainer = subprocess.Popen(
        [AREAL, "train", "--alloc", "fsdp:d1", "--trial", "trial0", SCRIPT],
        env={**os.environ, **ENV, "COLUMNS": "200"}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        # ps: the server's errors of the last minute and the last one's text, from the
        # registry entry its runner renews (no request to the server).
        def refused() -> dict | None:
            assert trainer.poll() is None, trainer.communicate()
            got = _errors(served)
            return got if got and got.get("streak", 0) >= 5 else None

        errors = wait_for(refused, 120, "no errors in areal ps --json")
        assert errors["source"] == "server" and errors["answered"] == 0
        last = errors["last"]
        assert (last["route"], last["status"], last["message"]) == (
            "POST /generate", 400, REFUSAL,
        )  # fmt: skip
        table = areal("ps", check=0).stdout
        assert f"{served} " in table and "errors " in table and "/min" in table, table

        # The watchdog: the rank moves (it retries), yet the job gets one verdict naming the
        # server and its message, in its log and in ps.
        logs = next((home / "logs").glob("*/default/trial0"))

        def said() -> str | None:
            assert trainer.poll() is None, trainer.communicate()
            try:
                text = (logs / "watchdog.log").read_text()
            except OSError:
                return None
            return text if "refused:" in text else None

        text = wait_for(said, 120, "no watchdog verdict")
        assert f"server {served} answered" in text and REFUSAL in text, text
        assert text.count("refused:") == 1  # once per episode
        watchdog = _job("train")["watchdog"]
        assert watchdog["kind"] == "server-refuses-requests" and REFUSAL in watchdog["summary"]
        assert "stalled: server-refuses-requests" in areal("ps", check=0).stdout

        # doctor hang on the job: its verdict names the server and the message.
        hang = areal("doctor", "hang", "--job", "default/trial0", "--json", check=0, timeout=120)
        verdict = json.loads(hang.stdout)["verdict"]
        assert f"server {served}" in verdict["summary"] and REFUSAL in verdict["summary"]
        shown = areal("doctor", "hang", "--job", "default/trial0", check=0, timeout=120).stdout
        assert REFUSAL in shown and served in shown
    finally:
        os.killpg(trainer.pid, signal.SIGTERM)
        trainer.communicate(timeout=60)
    assert trainer.returncode != 0
