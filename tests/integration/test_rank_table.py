"""Every training rank is in the registry while it lives; `areal ps` counts them; workers of a
job whose servers are not known at launch find them in the registry at run time."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time

import pytest

from areal_cli.registry import open_registry
from tests.helpers import AREAL, areal, fake_serve_args

WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    from areal_cli.worker import connect

    out = Path(sys.argv[1])
    ctx = connect()
    (out / f"rank{ctx.rank}.json").write_text(json.dumps({"servers": ctx.servers, "pid": os.getpid()}))
    while not (out / "go").exists():
        time.sleep(0.05)
    ctx.close()
    """
)


def _wait(pred, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


@pytest.fixture
def served(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    out = json.loads(
        areal(*fake_serve_args(model, "--alloc", "hf:d2", "--detach", "--json"), check=0).stdout
    )
    yield sorted(s["addr"] for s in out["servers"])
    areal("stop", "default/trial0", check=0)


@pytest.mark.slow
def test_ranks_are_recorded_while_they_live_and_servers_found_at_run_time(
    served, tmp_path, areal_env
):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    # No addresses at launch: the workers wait for servers in the registry themselves.
    env = {**os.environ, "AREAL_WAIT_SERVERS": "30"}
    proc = subprocess.Popen([AREAL, "train", "--alloc", "fsdp:d2", "--servers", "none",
                             str(script), str(out)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert _wait(lambda: len(list(out.glob("rank*.json"))) == 2, 120), proc.stderr
        got = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
        assert sorted(got[0]["servers"]) == sorted(got[1]["servers"]) == served
        ranks = open_registry(str(areal_env[1])).ranks("default", "trial0")
        assert [(r.rank, r.world_size, r.pid) for r in ranks] == [
            (0, 2, got[0]["pid"]), (1, 2, got[1]["pid"])
        ]  # fmt: skip
        (job,) = [j for j in json.loads(areal("ps", "--json", check=0).stdout)
                  if j["kind"] == "train"]  # fmt: skip
        assert (job["ranks_alive"], job["world_size"]) == (2, 2)
        (out / "go").write_text("")
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert open_registry(str(areal_env[1])).ranks("default", "trial0") == []
