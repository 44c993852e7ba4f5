"""An engine from outside areal: a distribution made here (a dist-info folder whose
entry_points.txt declares it in group areal_cli.engines, on PYTHONPATH) is all there is of
it. `areal serve` plans and launches it, the core asks it for its features, and a two-rank
gloo trainer syncs weights to it, with no line of src/ naming it.

The toy runs areal's reference server under a module of its own, behind a check of its own
environment, and declares features of its own (one GPU per replica, a first request)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import REPO, areal
from tests.integration.helpers_server import free_port

TRAINER = str(Path(__file__).parent / "sync_trainer.py")
PROMPT = [72, 101, 108, 108, 111]

TOY_INIT = """
from areal_cli.backends import Backend


class Toy(Backend):
    def argv(self, role, port, api_key, on_gpu):
        cmd = [role.python, "-m", "toyengine.server", "--model-path", role.model_path]
        cmd += ["--host", role.host, "--port", str(port), "--seed", str(role.seed)]
        return cmd + ["--device", "cpu", *role.extra_args]

    def fixed_env(self, role):
        return {"TOY_ENGINE_ENV": "set by the toy"}

    def first_request(self, role):
        return ["/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}]


ENGINE = Toy("toy", package="toyengine", extra="", needs_gpu=False, multi_gpu_replica=False)
"""

# The server refuses to start without the environment its engine declares: a plan that
# lost it fails here, not later.
TOY_SERVER = """
import os
import runpy
import sys

if os.environ.get("TOY_ENGINE_ENV") != "set by the toy":
    sys.exit("toyengine: started without its environment")
runpy.run_module("areal_cli.server", run_name="__main__", alter_sys=True)
"""


@pytest.fixture
def toy_site(tmp_path, monkeypatch):
    """The toy engine's distribution, first on the path of every process the test runs, this
    one included; what this process read of the engines is forgotten before and after."""
    from areal_cli import backends, plugins

    site = tmp_path / "site"
    pkg = site / "toyengine"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(TOY_INIT))
    (pkg / "server.py").write_text(textwrap.dedent(TOY_SERVER))
    info = site / "toyengine-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toyengine\nVersion: 0.1\n")
    (info / "top_level.txt").write_text("toyengine\n")
    # A second engine of the distribution is broken: asked for, it is one message; nothing
    # that asks every engine (ps, the default engine) trips over it.
    (info / "entry_points.txt").write_text(
        "[areal_cli.engines]\ntoy = toyengine:ENGINE\nbroken = toyengine.gone:ENGINE\n"
    )
    path = os.pathsep.join(filter(None, [str(site), str(REPO), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(backends, "_LOADED", {})
    plugins.refresh()
    yield site
    plugins.refresh()


@pytest.fixture
def tiny(tmp_path):
    from areal_cli.modelgen import create_tiny_model

    return create_tiny_model(tmp_path / "tiny", seed=0)


def test_a_toy_engine_plans_by_its_own_features(areal_env, toy_site, tiny):
    plan = json.loads(areal("serve", "--backend", "toy", "--model", str(tiny), "--dry-run",
                            "--json", check=0).stdout)  # fmt: skip
    (proc,) = plan["processes"]
    assert proc["argv"][1:3] == ["-m", "toyengine.server"], proc["argv"]
    assert proc["env"]["TOY_ENGINE_ENV"] == "set by the toy"
    # One GPU per replica, as it declares: a replica of two is refused, named after it.
    res = areal("serve", "--alloc", "toy:d1t2", "--model", str(tiny), "--dry-run", check=2)
    assert "the toy backend runs one replica per GPU" in res.stderr, res.stderr
    assert "--alloc toy:d2" in res.stderr and "Traceback" not in res.stderr
    res = areal("serve", "--backend", "broken", "--model", str(tiny), "--dry-run", check=2)
    assert "cannot load toyengine.gone:ENGINE" in res.stderr and "Traceback" not in res.stderr
    # An engine nobody installed is one message that lists the installed ones, the toy too.
    res = areal("serve", "--backend", "tooy", "--model", str(tiny), "--dry-run", check=2)
    assert "unknown backend 'tooy'" in res.stderr and "toy" in res.stderr.split("hint")[-1]


def test_a_toy_engine_serves_and_takes_weights_from_a_two_rank_trainer(areal_env, toy_site, tiny):
    areal("serve", "--backend", "toy", "--model", str(tiny), "--experiment", "toy",
          "--trial", "t0", "--detach", check=0, timeout=240)  # fmt: skip
    try:
        (job,) = [j for j in json.loads(areal("ps", "--json", check=0).stdout)
                  if j["kind"] == "serve"]  # fmt: skip
        (server,) = job["servers"]
        addr = server["addr"]
        # The toy takes the key `areal serve` made for it where its engine says (key_env).
        key = areal("key", "toy/t0", check=0).stdout.strip()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(free_port()), TRAINER, "--model", str(tiny),
               "--servers", addr, "--backend", "toy", "--syncs", "2"]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "AREAL_API_KEY": key}
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
        assert res.returncode == 0, res.stderr[-4000:]
        lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
        assert [x["ok"] for x in lines] == [True, True], lines
        # The server holds the trainer's weights: its greedy continuation is the trainer's.
        got = asyncio.run(_greedy(addr, key))
        assert got.output_ids == lines[-1]["expected"] and got.weight_version == "2", got
    finally:
        areal("stop", "toy/t0", check=0, timeout=60)


async def _greedy(addr: str, key: str):
    """The toy's greedy continuation of PROMPT, asked through the trainer's client."""
    from areal_cli.worker.rollout import RolloutClient

    client = RolloutClient([addr], backend="toy", api_key=key, retries=0)
    try:
        return await client.generate(PROMPT, max_new_tokens=6, temperature=0)
    finally:
        await client.close()
