"""Start the hf reference server as a real process on loopback, talk to it, and always kill it.

with HfServer(model_dir, log_dir) as srv:
    srv.wait_healthy()
    srv.post("/generate", {...})
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HttpError(Exception):
    def __init__(self, status: int, body: Any):
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


def request(
    url: str,
    body: Any = None,
    *,
    method: str | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30,
) -> tuple[int, Any]:
    """(status, decoded JSON or text); HTTP errors are returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data else "GET"))
    req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, _decode(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, _decode(e.read())


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


class HfServer:
    """`python -m areal_cli.server` in its own session; `stop()` kills the whole tree."""

    def __init__(self, model_path: Path, log_dir: Path, *args: str, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_dir) / f"hf-server-{self.port}.log"
        self._log = self.log_path.open("w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "areal_cli.server",
                "--model-path",
                str(model_path),
                "--port",
                str(self.port),
                *args,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"},
        )
        # Collected while the server lives, so teardown finds every descendant.
        self._tree: list[psutil.Process] = []

    def __enter__(self) -> HfServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health_status(self) -> int | None:
        """The /health status, or None while nothing listens yet."""
        try:
            return request(self.url + "/health", timeout=2)[0]
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None

    def wait_healthy(self, timeout: float = 120) -> list[int | None]:
        """Poll /health until 200; returns the statuses seen on the way."""
        seen: list[int | None] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            status = self.health_status()
            if not seen or seen[-1] != status:
                seen.append(status)
            if status == 200:
                self._remember_tree()
                return seen
            time.sleep(0.05)
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.log()}")

    def get(self, path: str, **kw: Any) -> tuple[int, Any]:
        return request(self.url + path, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        return request(self.url + path, body if body is not None else {}, method="POST", **kw)

    def terminate(self, timeout: float = 15) -> tuple[int, float]:
        """SIGTERM; (exit code, seconds it took)."""
        self._remember_tree()
        t = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout)
        return rc, time.monotonic() - t

    def stop(self) -> None:
        self._remember_tree()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for p in self._tree:
            try:
                p.kill()
            except psutil.Error:
                pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()

    def _remember_tree(self) -> None:
        try:
            parent = psutil.Process(self.proc.pid)
            for p in parent.children(recursive=True):
                if p not in self._tree:
                    self._tree.append(p)
        except psutil.Error:
            pass
