"""What only a CUDA machine can show: NCCL all_reduce, FSDP2 on CUDA, the hf server on a GPU.
Marked `gpu`; skipped where CUDA is absent."""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.helpers import REPO, areal

pytestmark = pytest.mark.gpu


def test_nccl_allreduce_table_is_correct():
    out = areal("doctor", "allreduce", "--backend", "nccl", "--nproc", "1", "--sizes", "1M:64M",
                "--json", check=0, timeout=300)  # fmt: skip
    data = json.loads(out.stdout)
    rows = data["rows"] if isinstance(data, dict) else data
    assert rows and all(r["wrong"] == 0 for r in rows)


def test_fsdp_on_cuda_trains_and_syncs_to_an_hf_server_on_cuda(tmp_path):
    from areal_cli.modelgen import create_tiny_model

    model = create_tiny_model(tmp_path / "tiny")
    out = json.loads(areal("serve", "--backend", "hf", "--model", str(model), "--gpus", "0",
                           "--detach", "--json", check=0, timeout=300).stdout)  # fmt: skip
    try:
        (server,) = out["servers"]
        assert server["gpus"] == [0]
        areal("train", "--alloc", "fsdp:d1", str(REPO / "templates/grpo/train.py"), "--config",
              str(REPO / "templates/grpo/tiny_cpu.yaml"), "steps=3", check=0, timeout=600)  # fmt: skip
        with urllib.request.urlopen(f"http://{server['addr']}/model_info") as r:
            assert json.loads(r.read())["weight_version"] == "3"
    finally:
        areal("stop", "default/trial0", check=0)
