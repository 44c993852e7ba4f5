"""`--model` takes what the backends take: a local directory or a hub id (org/name[@rev]).

The hf server loads a hub id through transformers from a Hugging Face cache laid out in a temp
HF_HOME; HF_HUB_OFFLINE=1 makes sure nothing is downloaded."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from areal_cli.registry import FileRegistry
from tests.helpers import areal

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    """A hub cache holding `tiny-org/tiny-model` at main, as huggingface_hub lays it out."""
    from areal_cli.modelgen import create_tiny_model

    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / "models--tiny-org--tiny-model"
    snap = repo / "snapshots" / COMMIT
    shutil.copytree(create_tiny_model(tmp_path_factory.mktemp("src") / "tiny"), snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return home


def offline(hf_home) -> dict:
    return {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow
def test_a_hub_id_from_the_local_cache_is_served_and_shown_as_given(hf_home, areal_env):
    home, reg = areal_env
    env = offline(hf_home)
    out = areal("serve", "--backend", "hf", "--model", "tiny-org/tiny-model", "--detach", "--json",
                env=env, check=0, timeout=120)  # fmt: skip
    try:
        (server,) = json.loads(out.stdout)["servers"]
        (entry,) = FileRegistry(reg).list().servers
        assert entry.model_path == "tiny-org/tiny-model"
        (job,) = json.loads(areal("ps", "--json", check=0).stdout)
        assert job["model"] == "tiny-org/tiny-model"
        assert "tiny-org/tiny-model" in areal("ps", check=0).stdout
        (rec,) = home.glob("jobs/*/default/trial0/serve.json")
        argv = json.loads(rec.read_text())["processes"][0]["argv"]
        assert argv[argv.index("--model-path") + 1] == "tiny-org/tiny-model"
    finally:
        areal("stop", "default/trial0", check=0)


@pytest.mark.slow
def test_a_hub_id_missing_offline_fails_with_the_servers_reason(hf_home):
    t0 = time.monotonic()
    res = areal("serve", "--backend", "hf", "--model", "tiny-org/absent", "--detach",
                env=offline(hf_home), check=1, timeout=120)  # fmt: skip
    assert time.monotonic() - t0 < 90
    assert "server-0 failed" in res.stderr and "cannot load tiny-org/absent" in res.stderr
    assert "Traceback" not in res.stderr.split("cannot load")[0]


def test_revision_and_hub_ids_reach_sglang_and_vllm_argv():
    env = {"CUDA_VISIBLE_DEVICES": "0,1"}
    plan = json.loads(areal("serve", "--backend", "sglang", "--model", "Qwen/Qwen2.5-1.5B-Instruct",
                            "--dry-run", "--json", env=env, check=0).stdout)  # fmt: skip
    argv = plan["processes"][0]["argv"]
    assert argv[argv.index("--model-path") + 1] == "Qwen/Qwen2.5-1.5B-Instruct"
    assert "--revision" not in argv and plan["model_path"] == "Qwen/Qwen2.5-1.5B-Instruct"
    plan = json.loads(areal("serve", "--backend", "vllm", "--model", "Qwen/Qwen2.5-1.5B@v1.0",
                            "--dry-run", "--json", env=env, check=0).stdout)  # fmt: skip
    argv = plan["processes"][0]["argv"]
    # vLLM starts as `python -m vllm.entrypoints.openai.api_server --model M` (its `vllm`
    # console script does not run from every distribution).
    assert argv[argv.index("--model") + 1] == "Qwen/Qwen2.5-1.5B"
    assert argv[argv.index("--revision") + 1] == "v1.0"
    assert plan["model_path"] == "Qwen/Qwen2.5-1.5B@v1.0"


@pytest.mark.parametrize(
    "model, needle",
    [
        ("./missing", "does not exist"),
        ("/nonexistent/model", "does not exist"),
        ("~/surely-missing-model-dir", "does not exist"),
        ("sub/missing", "does not exist"),  # ./sub exists, its child does not: a typo'd path
        ("missing-model", "does not exist"),  # a bare name is a local path here
        ("org/name@", "bad revision"),
        ("org/a/b", "neither a local directory nor a hub id"),
        ("org/na me", "neither a local directory nor a hub id"),
    ],
)
def test_clearly_missing_local_paths_exit_2(tmp_path, model, needle):
    # A run, not a dry run: a dry run plans a path this host lacks (on a cluster it may exist
    # only on the compute nodes) and says so in a note; a run refuses it before it starts.
    (tmp_path / "sub").mkdir()
    res = areal("serve", "--backend", "hf", "--model", model, "--api-key", "none",
                cwd=tmp_path, check=2)  # fmt: skip
    assert needle in res.stderr and "Traceback" not in res.stderr
