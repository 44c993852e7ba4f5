"""The requests AReaL 1.0.4's own trainer sends to an SGLang server, byte for byte in shape.

Read from github.com/inclusionAI/AReaL at tag v1.0.4:
    areal/engine/sglang_remote.py:56-75     /generate (SGLangBackend.build_generation_request)
    areal/engine/sglang_remote.py:147-158   /update_weights_from_disk
    areal/engine/sglang_remote.py:172-183   /update_weights_from_distributed: no session, no
                                            weight_version, abort_all_requests on every bucket
    areal/engine/sglang_remote.py:199-207   /init_weights_update_group: master_port as
                                            str(port), backend from the platform (CPU: gloo)
    areal/engine/sglang_remote.py:210-216   /pause_generation {} and /continue_generation {}
    areal/api/io_struct.py:39               ModelRequest.image_data defaults to []
    areal/api/cli_args.py:163-220           GenerationHyperparameters defaults (top_k 1e8 ...)
    areal/engine/fsdp_engine.py:1266-1320   a bucket: its request, then one broadcast per
                                            tensor from rank 0, then the reply

Run as a script, it is AReaL's rank 0 of an xccl weight sync against one server:

    python tests/conformance/areal_requests.py URL MODEL_DIR GROUP [init]

joins the group the way AReaL does (the request and the rendezvous together), sends every
tensor of MODEL_DIR in two buckets, each as its own session-less request (with `init`: only
joins and destroys the group), and prints one JSON line: the replies, in order.
"""

from __future__ import annotations

import json
import sys
import threading
import urllib.error
import urllib.request
from typing import Any


def generate(input_ids: list[int], max_new_tokens: int, *, greedy: bool = True) -> dict:
    sampling = {
        "top_p": 1.0,
        "top_k": int(1e8),
        "max_new_tokens": max_new_tokens,
        "temperature": 0.0 if greedy else 1.0,
        "stop_token_ids": [],
        "ignore_eos": False,
        "skip_special_tokens": True,
        "frequency_penalty": 0.0,
    }
    return {
        "input_ids": list(input_ids),
        "image_data": [],
        "sampling_params": sampling,
        "return_logprob": True,
        "stream": False,
    }


def update_from_disk(path: str) -> dict:
    return {"model_path": str(path), "abort_all_requests": True}


def init_group(port: int, group: str, *, server_idx: int = 0, tp: int = 1, n_servers: int = 1):
    return {
        "master_address": "127.0.0.1",
        "master_port": str(port),
        "rank_offset": 1 + server_idx * tp,
        "world_size": n_servers * tp + 1,
        "backend": "gloo",
        "group_name": group,
    }


def update_from_distributed(specs: list[tuple[str, tuple, str]], group: str) -> dict:
    return {
        "names": [name for name, _, _ in specs],
        "dtypes": [dtype for _, _, dtype in specs],
        "shapes": [list(shape) for _, shape, _ in specs],
        "group_name": group,
        "abort_all_requests": True,
    }


PAUSE = ("/pause_generation", {})
RESUME = ("/continue_generation", {})


def post(url: str, body: Any, timeout: float = 120) -> list:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return [r.status, json.loads(r.read() or b"null")]
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return [e.code, json.loads(raw)]
        except ValueError:
            return [e.code, raw.decode(errors="replace")]


def _together(url: str, body: Any, fn) -> list:
    out: dict[str, Any] = {}
    t = threading.Thread(target=lambda: out.update(r=post(url, body)))
    t.start()
    fn()
    t.join()
    return out["r"]


def main(argv: list[str]) -> int:
    from pathlib import Path

    from safetensors.torch import load_file

    from areal_cli.backends import weight_group

    url, model_dir, group_name, *only = argv
    weights = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        weights.update(load_file(str(f)))
    store = weight_group.listen("127.0.0.1", 2, 60)
    holder: dict[str, Any] = {}

    def join() -> None:
        holder["g"] = weight_group.join(master_address="127.0.0.1", master_port=store.port,
                                        rank=0, world_size=2, group_name=group_name,
                                        backend="gloo", timeout_s=60, store=store)  # fmt: skip

    replies = {"init": _together(url + "/init_weights_update_group",
                                 init_group(store.port, group_name), join)}  # fmt: skip
    group = holder["g"]
    if only == ["init"]:
        replies["destroy"] = post(url + "/destroy_weights_update_group", {"group_name": group_name})
        group.close()
        print(json.dumps(replies))
        return 0
    replies["pause"] = post(url + PAUSE[0], PAUSE[1])
    names = sorted(weights)
    half = len(names) // 2
    replies["buckets"] = []
    for bucket in (names[:half], names[half:]):
        tensors = [weights[n].contiguous() for n in bucket]
        specs = [(n, tuple(t.shape), str(t.dtype).split("torch.")[1])
                 for n, t in zip(bucket, tensors, strict=True)]  # fmt: skip

        def send(tensors=tensors) -> None:
            for t in tensors:  # fsdp_engine.py:1308-1316: one broadcast per tensor
                group.broadcast(t, 60)

        replies["buckets"].append(_together(url + "/update_weights_from_distributed",
                                            update_from_distributed(specs, group_name), send))  # fmt: skip
    replies["resume"] = post(url + RESUME[0], RESUME[1])
    replies["destroy"] = post(url + "/destroy_weights_update_group", {"group_name": group_name})
    group.close()
    print(json.dumps(replies))
    return 0


def same_as_areal() -> None:
    """Run by AReaL's own interpreter: each payload above equals the one AReaL 1.0.4's
    SGLangBackend builds, or AssertionError."""
    from areal.api import ModelAllocation, ModelRequest
    from areal.api.cli_args import GenerationHyperparameters
    from areal.api.io_struct import ParamSpec, WeightUpdateMeta
    from areal.engine.sglang_remote import SGLangBackend

    b = SGLangBackend()
    ids = [72, 101, 108, 108, 111]
    req = ModelRequest(input_ids=ids, gconfig=GenerationHyperparameters(max_new_tokens=4,
                                                                        greedy=True))  # fmt: skip
    assert b.build_generation_request(req, with_lora=False, version=0).payload == generate(ids, 4)
    meta = WeightUpdateMeta(type="xccl", nccl_master_address="127.0.0.1",
                            nccl_master_port=29511, nccl_group_name="g",
                            gen_allocation=ModelAllocation.from_str("sglang:d1", name="rollout"))  # fmt: skip
    assert b.build_init_weights_group_request("x", 0, meta).payload == init_group(29511, "g")
    specs = [("a", (2, 3), "float32"), ("b", (4,), "bfloat16")]
    got = b.build_distributed_weight_update_requests(meta, [ParamSpec(*s) for s in specs])
    assert json.loads(json.dumps(got.requests[0].payload)) == update_from_distributed(specs, "g")
    got = b.build_disk_weight_update_requests(WeightUpdateMeta(type="disk", path="/m"))
    assert got.requests[0].payload == update_from_disk("/m")
    assert (b.get_pause_request().payload, b.get_resume_request().payload) == (PAUSE[1], RESUME[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
