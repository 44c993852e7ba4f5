"""Readiness as the real engines need it, against small real HTTP servers on loopback:

- a replica is ready only once it answered one tiny generation after /health: vLLM's CPU
  build answered /health and died on its first request (head size 16);
- SGLang's /ready turns 200 only after its own warm-up generation: readiness polls that,
  not /health (a second and more), and sends no generation of its own;
- discovery waits long enough for SGLang's /health, which answers after at least a second
  (srt/entrypoints/http_server.py:777-779: it sleeps 1 s before looking for its token);
- a replica is pinned to the cores its plan gives it.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from areal_cli import discovery, settings
from areal_cli.registry import FileRegistry, ServerEntry

# A server that answers /health at once and, on its first POST /generate, dies like vLLM's
# engine (MODE=die, exit 9), answers 500 (MODE=500) or answers 200 (MODE=ok). It prints
# the cores it may run on.
SERVER = r"""
import http.server, json, os, sys
port, mode = int(sys.argv[1]), sys.argv[2]
print("cores", sorted(os.sched_getaffinity(0)), flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        print("first request", self.path, self.rfile.read(n).decode(), flush=True)
        if mode == "die":
            print("Unsupported CPU attention configuration: head_dim=16", flush=True)
            os._exit(9)
        body = b'{"error": "boom"}' if mode == "500" else b'{"text": ""}'
        self.send_response(500 if mode == "500" else 200)
        self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def run_replica(tmp_path: Path, mode: str, cpus: list[int]) -> tuple[int, str, FileRegistry]:
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    log = tmp_path / "server-0.log"
    reg = tmp_path / "reg"
    plan = {
        "experiment": "e", "trial": "t", "registry": str(reg), "marker": "m-ready",
        "health_timeout": 30, "registry_ttl": 30, "api_key": None, "model_path": "/m",
        "processes": [{
            "role": "server", "index": 0, "argv": [sys.executable, str(script), "{port}", mode],
            "env": {}, "gpus": [], "log_path": str(log), "host": "127.0.0.1", "port": None,
            "backend": "sglang", "health_path": "/health", "cpus": cpus,
            "first_request": ["/generate", {"input_ids": [0], "sampling_params": {
                "max_new_tokens": 1}}],
        }],
    }  # fmt: skip
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    runner = subprocess.Popen(
        [sys.executable, "-m", "areal_cli.launchers.replica", str(path), "--index", "0"]
    )
    if mode == "ok":  # it stays up: wait for the registration, then stop it
        deadline = time.monotonic() + 30
        while not FileRegistry(reg).list("e", "t").servers and time.monotonic() < deadline:
            time.sleep(0.05)
        assert FileRegistry(reg).list("e", "t").servers, log.read_text()
        runner.terminate()
    return runner.wait(timeout=60), log.read_text(), FileRegistry(reg)


def test_a_server_that_dies_on_its_first_request_is_never_ready(tmp_path):
    code, log, reg = run_replica(tmp_path, "die", [])
    assert code == 9, log
    assert '"input_ids": [0]' in log  # the tiny generation of the plan
    assert "server exited on its first request (exit code 9)" in log
    assert reg.list("e", "t").servers == []  # never registered, so never discovered


def test_a_server_that_fails_its_first_request_is_stopped(tmp_path):
    code, log, reg = run_replica(tmp_path, "500", [])
    assert code == 3, log
    assert 'failed its first request: POST /generate: HTTP 500 {"error": "boom"}' in log
    assert reg.list("e", "t").servers == []


def test_a_server_that_answers_is_registered_on_its_own_cores(tmp_path):
    mine = sorted(os.sched_getaffinity(0))
    code, log, _ = run_replica(tmp_path, "ok", mine[-1:])
    assert f"cores {mine[-1:]}" in log and "registered 127.0.0.1:" in log, log


# SGLang's readiness as 0.5.23 serves it (srt/entrypoints/http_server.py): /ready 503 until
# its own warm-up generation was answered (here: 0.3 s after start), 200 after; /health a
# second and more. It prints each request it gets.
SGLANG_LIKE = r"""
import http.server, sys, time
port = int(sys.argv[1])
up_at = time.monotonic() + 0.3
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        print("GET", self.path, flush=True)
        if self.path == "/health":
            time.sleep(1.2)
        ok = time.monotonic() >= up_at
        self.send_response(200 if ok else 503)
        self.send_header("Content-Length", "0"); self.end_headers()
    def do_POST(self):
        print("POST", self.path, flush=True)
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers()
        self.wfile.write(b"{}")
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_sglang_is_ready_on_its_ready_route_without_a_generation_of_ours(tmp_path):
    # The plan as `areal serve --backend sglang` makes it: SGLang's /ready answering proves
    # its warm-up generation was answered, so no first request (backends.SGLang).
    from areal_cli import backends
    from areal_cli.spec import ServerRole

    role = ServerRole(backend="sglang", model_path="/m", replicas=1, python=sys.executable)
    assert backends.get("sglang").first_request(role) is None
    script = tmp_path / "server.py"
    script.write_text(SGLANG_LIKE)
    log, reg = tmp_path / "server-0.log", tmp_path / "reg"
    plan = {
        "experiment": "e", "trial": "t", "registry": str(reg), "marker": "m-ready",
        "health_timeout": 30, "registry_ttl": 30, "api_key": None, "model_path": "/m",
        "processes": [{
            "role": "server", "index": 0, "argv": [sys.executable, str(script), "{port}"],
            "env": {}, "gpus": [], "log_path": str(log), "host": "127.0.0.1", "port": None,
            "backend": "sglang", "health_path": "/health", "first_request": None,
        }],
    }  # fmt: skip
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    runner = subprocess.Popen([sys.executable, "-m", "areal_cli.launchers.replica",
                               str(tmp_path / "plan.json"), "--index", "0"])  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not FileRegistry(reg).list("e", "t").servers and time.monotonic() < deadline:
            time.sleep(0.02)
        text = log.read_text()
        assert FileRegistry(reg).list("e", "t").servers, text
    finally:
        runner.terminate()
        runner.wait(timeout=30)
    before = text[: text.index("[replica]")]
    assert "GET /ready" in before, text
    assert "GET /health" not in before and "POST" not in before, text


class _SlowHealth(http.server.BaseHTTPRequestHandler):
    """/health as SGLang answers it: 200 after a little more than a second."""

    def log_message(self, *a):
        pass

    def do_GET(self):
        time.sleep(1.2)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture
def slow_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowHealth)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("wait", [0.0, 1.0])
def test_discovery_sees_a_server_whose_health_takes_a_second(tmp_path, slow_server, wait):
    reg = FileRegistry(tmp_path / "reg")
    reg.register(ServerEntry(id="s", addr=slow_server, experiment="e", trial="t",
                             host=settings.hostname(), pid=os.getpid()))  # fmt: skip
    found = discovery.from_registry(reg, tmp_path / "home", "e", "t", 1, wait)
    assert found.addrs == [slow_server]
