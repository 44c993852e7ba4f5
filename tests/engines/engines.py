"""The real engines' CPU builds (scripts/engines.sh, `make engines`) served by `areal serve`.

    srv = EngineServer.start("sglang", model, tmp)   # areal serve --detach --python <venv>
    srv.post("/generate", {...}); srv.areal("ps", "--json"); srv.stop()   # areal stop

One server per engine per test module (they take 25-60 s to be healthy and ~2.7 GB each).
`missing(engine)` says why an engine cannot run here; the tier skips then, or fails when
AREAL_REQUIRE_ENGINES=1 (tests/engines/conftest.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from areal_cli import apikeys, backends
from tests.helpers import live_with_home
from tests.integration.helpers_server import request

AREAL = str(Path(sys.executable).parent / "areal")
REQUIRE = "AREAL_REQUIRE_ENGINES"
STAMP = ".areal-engine"  # written by scripts/engines.sh once a venv is built and imports


def python_of(engine: str) -> Path:
    return Path(backends.engine_python(engine))


def missing(engine: str) -> str | None:
    """Why `engine`'s CPU build cannot run here, or None."""
    py = python_of(engine)
    if not py.exists() or not (py.parent.parent / STAMP).exists():
        return f"{engine}'s CPU build is not built in {py.parent.parent} (run `make engines`)"
    return None


@dataclass
class EngineServer:
    engine: str
    home: Path
    registry: Path
    experiment: str
    trial: str
    addr: str
    key: str | None
    log_path: Path
    seconds_to_ready: float
    pids: list[int] = field(default_factory=list)

    @classmethod
    def start(
        cls, engine: str, model: Path, root: Path, *extra: str, api_key: str = "auto",
        trial: str = "t0", timeout: float = 420,
    ) -> EngineServer:  # fmt: skip
        home, registry = root / "home", root / "registry"
        experiment = f"eng-{engine}"
        args = ["serve", "--backend", engine, "--model", str(model), "--python",
                str(python_of(engine)), "--experiment", experiment, "--trial", trial,
                "--api-key", api_key, "--detach", "--json", *extra]  # fmt: skip
        started = time.monotonic()
        srv = cls(engine, home, registry, experiment, trial, "", None, Path(), 0.0)
        try:
            res = run_areal(home, registry, *args, timeout=timeout)
        except BaseException:
            # Interrupted while the engine loads (pytest's timeout, Ctrl-C): the detached
            # job lives on without the command, and would hold its 3 GB past the test.
            srv.stop()
            raise
        srv.seconds_to_ready = time.monotonic() - started
        if res.returncode != 0:
            srv.stop()
            logs = "\n".join(p.read_text(errors="replace")[-3000:]
                             for p in (home / "logs").rglob("server-*.log"))  # fmt: skip
            raise RuntimeError(f"areal serve {engine} exited {res.returncode}:\n"
                               f"{res.stderr[-3000:]}\n{logs}")  # fmt: skip
        out = json.loads(res.stdout)
        server = out["servers"][0] if "servers" in out else out["processes"][0]
        srv.addr = server.get("addr") or f"{server['host']}:{server['port']}"
        srv.log_path = Path(server.get("log") or server.get("log_path"))
        held = apikeys.load(apikeys.key_file(home, experiment, trial))
        srv.key = held[1] if held else None
        srv.pids = [p.pid for p in srv.processes()]
        return srv

    @property
    def url(self) -> str:
        return f"http://{self.addr}"

    @property
    def name(self) -> str:
        return f"{self.experiment}/{self.trial}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def get(self, path: str, **kw: Any) -> tuple[int, Any]:
        kw["headers"] = {**self.headers(), **kw.get("headers", {})}
        return request(self.url + path, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        kw["headers"] = {**self.headers(), **kw.get("headers", {})}
        kw.setdefault("timeout", 120)
        return request(self.url + path, body if body is not None else {}, method="POST", **kw)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def areal(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return run_areal(self.home, self.registry, *args, timeout=timeout)

    def processes(self) -> list[psutil.Process]:
        """Live processes that carry this server's AREAL_HOME (runner, engine, its workers)."""
        return live_with_home(self.home)

    def stop(self) -> subprocess.CompletedProcess:
        res = self.areal("stop", self.name, timeout=120)
        deadline = time.monotonic() + 30
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        for p in self.processes():  # a failed stop must not leave 3 GB behind
            try:
                p.kill()
            except psutil.Error:
                pass
        return res


def run_areal(home: Path, registry: Path, *args: str, timeout: float = 120):
    env = {**os.environ, "AREAL_HOME": str(home), "AREAL_REGISTRY": str(registry),
           "CUDA_VISIBLE_DEVICES": "", "COLUMNS": "200", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    env.pop("OMP_NUM_THREADS", None)  # each replica gets its own cores' worth
    # Module fixtures start before the per-test port block is set (tests/conftest.py): a
    # block of the tier's own, below the kernel's ephemeral ports (32768-60999 here): an
    # engine binds its port only after loading, a minute in which any connect() or
    # bind(0) on the machine may take a port in that range.
    base = int(os.environ.get("AREAL_TEST_PORT_BASE", "30000"))
    env.setdefault("AREAL_PORT_BASE", str(20000 + base % 10000 + 700))
    return subprocess.run(
        [AREAL, *args], capture_output=True, text=True, timeout=timeout, env=env,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


def transformers_logprobs(model: Path, prompt: list[int], output: list[int]) -> list[float]:
    """log p(output[i] | prompt + output[:i]) under transformers, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(lm(ids).logits[0].float(), dim=-1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)]
