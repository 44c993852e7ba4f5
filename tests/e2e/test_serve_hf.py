"""`areal serve --backend hf` with the real reference server on a real tiny model."""

from __future__ import annotations

import json
import stat
import urllib.error
import urllib.request

import pytest

from areal_cli import apikeys
from areal_cli.registry import FileRegistry
from tests.helpers import REPO, areal

SCRIPT = str(REPO / "tests" / "fixtures" / "scripts" / "record_env.py")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from areal_cli.modelgen import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def post(url, body, key=None):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_serve_beyond_loopback_requires_the_generated_key(tiny, areal_env, tmp_path):
    home, reg = areal_env
    out = areal("serve", "--backend", "hf", "--model", str(tiny), "--host", "0.0.0.0", "--detach",
                "--json", check=0, timeout=120)  # fmt: skip
    try:
        (server,) = json.loads(out.stdout)["servers"]
        port = server["addr"].rsplit(":", 1)[1]
        key_file = apikeys.key_file(home, "default", "trial0")
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        key = json.loads(key_file.read_text())["key"]
        (entry,) = FileRegistry(reg).list("default", "trial0").servers
        assert entry.api_key_required and entry.backend == "hf"
        url = f"http://127.0.0.1:{port}/generate"
        body = {
            "input_ids": [5, 6, 7],
            "sampling_params": {"max_new_tokens": 4},
            "return_logprob": True,
        }
        with pytest.raises(urllib.error.HTTPError) as e:
            post(url, body)
        assert e.value.code == 401
        got = post(url, body, key)
        assert len(got["output_ids"]) == 4 and len(got["meta_info"]["output_token_logprobs"]) == 4
        # areal train hands the key to its workers.
        rec = tmp_path / "rec"
        rec.mkdir()
        areal(
            "train",
            "--alloc",
            "fsdp:d1",
            SCRIPT,
            env={"RECORD_DIR": str(rec)},
            check=0,
            timeout=120,
        )
        env = json.loads((rec / "rank-0.json").read_text())["env"]
        assert env["AREAL_API_KEY"] == key and env["AREAL_SERVER_BACKEND"] == "hf"
    finally:
        areal("stop", "default/trial0", check=0)
    assert FileRegistry(reg).list().servers == []
