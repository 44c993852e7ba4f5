"""The hf server against SGLang 0.5.23's HTTP contract, route by route.

Every golden request and reply shape here is read from the sglang 0.5.23 wheel; each test
names the file and lines it encodes (paths relative to the `sglang/` package). The server
is the real `python -m areal_cli.server` on loopback with a tiny model, and, in the
`engines` tier (`make test-engines`), the real SGLang 0.5.23 CPU engine under `areal serve`
with the same requests and the same expected answers: the stand-in passes what the engine
passes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from areal_cli.modelgen import create_tiny_model
from tests.conformance import areal_requests
from tests.integration.helpers_server import HfServer

AREAL_SENDER = Path(areal_requests.__file__)

PROMPT = [72, 101, 108, 108, 111]
GREEDY = {"max_new_tokens": 4, "temperature": 0}

# api/v1/api_types.py:1256 — the accepted sampling keys, in the order of the error text.
SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
    "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "min_new_tokens", "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval",
    "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "base": create_tiny_model(root / "base", seed=0),
        "other": create_tiny_model(root / "other", seed=1),
    }


@pytest.fixture(scope="module", params=["hf", pytest.param("sglang", marks=pytest.mark.engines)])
def server(request, models, tmp_path_factory):
    if request.param == "sglang":
        from tests.engines.engines import EngineServer

        srv = EngineServer.start("sglang", models["base"], tmp_path_factory.mktemp("sglang"),
                                 "--seed", "0", api_key="none")  # fmt: skip
        try:
            yield srv
        finally:
            srv.stop()
        return
    srv = HfServer(models["base"], tmp_path_factory.mktemp("logs"), "--seed", "0")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def gen(srv: HfServer, sampling=None, **extra) -> tuple[int, object]:
    return srv.post("/generate", {"input_ids": PROMPT, "sampling_params": sampling or GREEDY,
                                  **extra})  # fmt: skip


def version(srv: HfServer) -> str:
    return srv.get("/model_info")[1]["weight_version"]


# -- probes and info ---------------------------------------------------------------------------


def test_probes_answer_empty_bodies(server):
    # srt/entrypoints/http_server.py:714-719 (/ready), :721-800 (/health, /health_generate):
    # Response(status_code=200) with no body.
    for path in ("/health", "/health_generate", "/ready", "/ping"):
        assert server.get(path) == (200, "")


def test_model_info_shape(server, models):
    # srt/entrypoints/http_server.py:812-850
    status, info = server.get("/model_info")
    assert status == 200
    assert set(info) >= {
        "model_path", "served_model_name", "tokenizer_path", "is_generation",
        "preferred_sampling_params", "weight_version", "load_format", "reasoning_parser",
        "tool_call_parser", "disaggregation_mode", "has_image_understanding",
        "has_audio_understanding", "model_type", "architectures",
    }  # fmt: skip
    # srt/arg_groups/fields/serving.py:172-175: the version a server starts with.
    assert info["weight_version"] == "default"
    assert info["is_generation"] is True and info["architectures"] == ["Qwen2ForCausalLM"]
    # :802-809: the deprecated alias still answers the same.
    assert server.get("/get_model_info")[1] == info


def test_server_info_has_the_parallel_sizes_a_trainer_needs(server):
    # srt/entrypoints/http_server.py:863-895: server_args fields (tp_size, pp_size,
    # dp_size, random_seed ...) plus startup_time, internal_states.
    status, info = server.get("/server_info")
    assert status == 200
    assert (info["tp_size"], info["pp_size"], info["dp_size"]) == (1, 1, 1)
    assert info["random_seed"] == 0 and "startup_time" in info and "internal_states" in info
    # srt/utils/common.py:3589: the engine lists every server arg, api_key among them (None
    # without a key); the stand-in leaves it out. Neither ever shows a key here.
    assert info.get("api_key") is None


def test_removed_route_is_gone(server):
    # 0.5.23 serves no /get_weight_version (grep of srt/entrypoints/http_server.py).
    assert server.get("/get_weight_version")[0] == 404


# -- /generate ---------------------------------------------------------------------------------


def test_generate_reply_shape(server):
    status, body = gen(server, {"max_new_tokens": 4, "temperature": 0}, return_logprob=True)
    assert status == 200
    assert set(body) == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    # srt/managers/tokenizer_manager.py:2507-2513 (id, finish_reason, prompt_tokens,
    # weight_version, num_retractions), :2554-2560 (reasoning/completion/cached tokens),
    # :2868-2870 (input/output_token_logprobs, output_token_logprobs_length),
    # srt/utils/weight_versions.py:90-107 (weight_versions spans), :2753 (e2e_latency).
    assert set(meta) >= {
        "id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions",
        "input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length",
        "reasoning_tokens", "completion_tokens", "cached_tokens", "weight_versions",
        "e2e_latency",
    }  # fmt: skip
    n = meta["completion_tokens"]
    assert meta["output_token_logprobs_length"] == n == len(body["output_ids"])
    # api/v1/api_types.py:340-355: a logprob entry is [logprob, token_id, text|null].
    assert [e[1] for e in meta["output_token_logprobs"]] == body["output_ids"]
    assert all(len(e) == 3 and e[2] is None for e in meta["output_token_logprobs"])
    # srt/managers/scheduler.py:3260-3264: logprob_start_len -1 -> no input logprobs.
    assert meta["input_token_logprobs"] == []
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": n}]
    assert meta["num_retractions"] == 0
    # srt/managers/schedule_batch.py:320-329
    assert meta["finish_reason"] == {"type": "length", "length": 4}


def test_unknown_sampling_key_is_a_contract_error(server):
    # api/v1/api_types.py:97-108 (text), :1259-1320 (unknown keys rejected),
    # srt/entrypoints/http_server.py:937-939 (400, {"error": "<text>"}).
    status, body = gen(server, {"max_new_tokens": 2, "seed": 1})
    listed = ", ".join(f"`{f}`" for f in SAMPLING_FIELDS)
    assert status == 400
    assert body == {"error": f"unknown field `seed`, expected one of {listed}"}
    # The seed key SGLang knows is accepted.
    assert gen(server, {"max_new_tokens": 2, "sampling_seed": 1})[0] == 200


@pytest.mark.parametrize(
    ("sampling", "text"),
    [
        # api/v1/api_types.py:30-50, :73-76 (f64), :59-62 (i64)
        ({"temperature": "hot"}, 'invalid type: string "hot", expected f64'),
        ({"top_k": 1.5}, "invalid type: floating point `1.5`, expected i64"),
        ({"ignore_eos": 1}, "invalid type: integer `1`, expected a boolean"),
    ],
)
def test_wrong_json_types_are_contract_errors(server, sampling, text):
    assert gen(server, sampling) == (400, {"error": text})


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        # srt/sampling/sampling_params.py:259-260, :263-266, :256-258, :286-289
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
        ({"top_k": 0}, "top_k must be -1 (disable) or at least 1, got 0."),
        # The engine keeps a JSON integer an int: "-1", not "-1.0".
        ({"temperature": -1}, "temperature must be a non-negative finite number, got -1."),
        ({"max_new_tokens": -2}, "max_new_tokens must be at least 0, got -2."),
    ],
)
def test_semantic_errors_have_the_value_error_shape(server, sampling, message):
    # srt/entrypoints/http_server.py:2246-2250: {"error": {"message": str(e)}}
    assert gen(server, sampling) == (400, {"error": {"message": message}})


def test_no_prompt_and_empty_prompt(server):
    # srt/managers/io_struct.py:445-455 and :497-499
    assert server.post("/generate", {"sampling_params": GREEDY}) == (
        400,
        {"error": {"message": "Either text, input_ids or input_embeds should be provided."}},
    )
    status, body = server.post("/generate", {"input_ids": [], "sampling_params": GREEDY})
    assert (status, body) == (400, {"error": {"message": "input_ids cannot be empty."}})


def test_unknown_top_level_keys_are_ignored(server):
    # api/v1/api_types.py:236-238: GenerateRequest ignores unknown keys.
    assert gen(server, GREEDY, not_a_field=1)[0] == 200


@pytest.mark.engines
def test_these_are_areals_own_requests():
    # The payloads of areal_requests.py, against what AReaL 1.0.4's SGLangBackend builds in
    # AReaL's own venv (`make engines` builds it).
    from tests.engines.engines import missing, python_of

    why = missing("areal")
    if why:
        pytest.skip(why)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import areal_requests; "
            "areal_requests.same_as_areal()")  # fmt: skip
    res = subprocess.run([str(python_of("areal")), "-c", code, str(AREAL_SENDER.parent)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]


def test_areal_generate_request_is_answered(server):
    # AReaL 1.0.4's /generate (areal/engine/sglang_remote.py:56-75): "image_data": [] on
    # every request, its sampling defaults (top_k 1e8, frequency_penalty 0.0, an empty
    # stop_token_ids), return_logprob. AReaL reads output_token_logprobs [[lp, id, _]...]
    # and finish_reason.type (:87-123).
    status, body = server.post("/generate", areal_requests.generate(PROMPT, 4))
    assert status == 200, body
    meta = body["meta_info"]
    assert [e[1] for e in meta["output_token_logprobs"]] == body["output_ids"]
    assert len(body["output_ids"]) == 4 and meta["finish_reason"]["type"] == "length"


@pytest.mark.parametrize(
    "media",
    [
        {"image_data": []},
        {"image_data": [None]},
        {"image_data": None},
        {"video_data": []},
        {"audio_data": [None]},
        {"image_data": [], "video_data": [], "audio_data": []},
    ],
)
def test_empty_media_fields_mean_none(server, media):
    # srt/managers/io_struct.py:398-403 (contains_mm_input) -> has_valid_data
    # (srt/multimodal/mm_utils.py:53-58): null, [] and [null] hold no item, and the request
    # is served as text only; the same rule in 0.5.10.post1 (mm_utils.py:56-61, io_struct.py
    # :248-253). Greedy, so the answer is the text-only one.
    plain = gen(server)
    assert plain[0] == 200
    status, body = gen(server, **media)
    assert status == 200, body
    assert body["output_ids"] == plain[1]["output_ids"]


def test_a_media_field_of_the_wrong_json_type_is_a_contract_error(server):
    # api/v1/api_types.py:2034-2043 (MediaInput: a string, a map or lists of them).
    assert gen(server, image_data=5) == (
        400,
        {"error": "invalid type: integer `5`, expected one of the MediaInput shapes"},
    )


def test_batch_replies_one_object_per_prompt(server):
    # srt/managers/io_struct.py:505-530: a list of lists of ids is a batch.
    status, body = server.post(
        "/generate", {"input_ids": [PROMPT, PROMPT[:2]], "sampling_params": GREEDY, "rid": "b"}
    )
    assert status == 200 and [r["meta_info"]["id"] for r in body] == ["b_0", "b_1"]


# -- pause, continue, abort, flush -------------------------------------------------------------


def test_pause_and_continue_replies(server):
    # srt/entrypoints/http_server.py:1831-1856
    assert server.post("/pause_generation", {"mode": "retract"}) == (
        200,
        {"message": "Generation paused successfully.", "status": "ok"},
    )
    assert server.post("/continue_generation", {}) == (
        200,
        {"message": "Generation continued successfully.", "status": "ok"},
    )
    # srt/managers/io_struct.py:1946: mode is a Literal; pydantic refuses others with 400
    # and the ErrorResponse body (srt/entrypoints/http_server.py:636-698).
    status, body = server.post("/pause_generation", {"mode": "freeze"})
    assert status == 400 and body["object"] == "error" and body["code"] == 400


def _in_background(fn, *args):
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(result=fn(*args)))
    t.start()
    return t, out


LONG = {"max_new_tokens": 300, "ignore_eos": True, "temperature": 1.0}


def _running(srv) -> int:
    info = srv.get("/server_info")[1]
    if "batching" in info:  # the stand-in's own counters
        return info["batching"]["running"]
    # srt/entrypoints/v1_loads.py:96-140: the engine's load per DP rank.
    return sum(load["num_running_reqs"] for load in srv.get("/v1/loads?include=core")[1]["loads"])


def _wait_running(srv) -> None:
    deadline = time.monotonic() + 30
    while _running(srv) == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.01)


def test_pause_abort_mode_answers_in_flight_requests_as_aborted(server):
    # srt/managers/io_struct.py:1946 (default mode abort), tokenizer_manager.py:2267-2280;
    # srt/managers/schedule_batch.py:332-345: the abort finish reason's four keys.
    t, out = _in_background(gen, server, LONG)
    _wait_running(server)
    assert server.post("/pause_generation", {})[0] == 200
    t.join(30)
    server.post("/continue_generation", {})
    status, body = out["result"]
    assert status == 200
    assert body["meta_info"]["finish_reason"] == {
        "type": "abort", "message": "Aborted", "status_code": None, "err_type": None,
    }  # fmt: skip
    assert len(body["output_ids"]) < 300


def test_pause_retract_resumes_on_new_weights_with_version_spans(server, models):
    # srt/managers/scheduler.py:5817-5900 (retract: running requests back to the queue),
    # srt/utils/weight_versions.py:39-107 (spans over output positions per version),
    # srt/managers/tokenizer_manager.py:2512 (num_retractions).
    t, out = _in_background(gen, server, LONG)
    _wait_running(server)
    assert server.post("/pause_generation", {"mode": "retract"})[0] == 200
    status, res = server.post(
        "/update_weights_from_disk", {"model_path": str(models["other"]), "weight_version": "r1"}
    )
    assert status == 200 and res["success"] is True
    server.post("/continue_generation", {})
    t.join(60)
    status, body = out["result"]
    meta = body["meta_info"]
    assert status == 200 and len(body["output_ids"]) == 300
    assert meta["num_retractions"] == 1 and meta["weight_version"] == "r1"
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "r1"]
    assert (
        spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 300
    )
    server.post("/update_weights_from_disk", {"model_path": str(models["base"]),
                                              "weight_version": "default"})  # fmt: skip


def test_in_place_pause_keeps_the_cache_so_an_update_cannot_flush(server, models):
    # srt/managers/scheduler.py:5821-5831 (in_place keeps the running batch),
    # srt/managers/scheduler_components/weight_updater.py:120-135 (a flush refused fails the
    # update with this message; the weights changed), srt/entrypoints/http_server.py:1025-1040.
    t, out = _in_background(gen, server, LONG)
    _wait_running(server)
    assert server.post("/pause_generation", {"mode": "in_place"})[0] == 200
    before = version(server)
    status, res = server.post(
        "/update_weights_from_disk", {"model_path": str(models["base"]), "weight_version": "x"}
    )
    assert status == 400 and res["success"] is False
    assert res["message"].startswith("Weights were updated, but the cache was not flushed")
    assert version(server) == before
    assert server.post("/flush_cache", {}) == (400, "Flush cache failed.\n")
    server.post("/continue_generation", {})
    t.join(60)
    assert out["result"][0] == 200 and len(out["result"][1]["output_ids"]) == 300
    assert server.get("/flush_cache")[1].startswith("Cache flushed.\n")


def test_abort_request_answers_an_empty_body(server):
    # srt/entrypoints/http_server.py:1721-1731, srt/managers/io_struct.py:2285-2296
    t, out = _in_background(gen, server, LONG)
    _wait_running(server)
    assert server.post("/abort_request", {"abort_all": True}) == (200, "")
    t.join(30)
    assert out["result"][1]["meta_info"]["finish_reason"]["type"] == "abort"
    rid_t, rid_out = _in_background(
        lambda: server.post(
            "/generate", {"input_ids": PROMPT, "sampling_params": LONG, "rid": "one"}
        )  # fmt: skip
    )
    _wait_running(server)
    assert server.post("/abort_request", {"rid": "one"}) == (200, "")
    rid_t.join(30)
    assert rid_out["result"][1]["meta_info"]["finish_reason"]["type"] == "abort"


# -- weights -----------------------------------------------------------------------------------


def test_update_from_disk_reply_and_version_rules(server, models):
    # srt/entrypoints/http_server.py:1300-1326: {success, message, num_paused_requests};
    # srt/managers/io_struct.py:1970-1993: weight_version is Optional[str];
    # srt/managers/tokenizer_manager.py:2313-2318: the version moves only when one is given.
    was = version(server)
    status, res = server.post("/update_weights_from_disk", {"model_path": str(models["base"])})
    assert (status, set(res)) == (200, {"success", "message", "num_paused_requests"})
    assert res["message"] == "Succeeded to update model weights." and version(server) == was
    status, res = server.post(
        "/update_weights_from_disk", {"model_path": str(models["base"]), "weight_version": "7"}
    )
    assert res["message"] == "Succeeded to update model weights. Weight version updated to 7."
    assert version(server) == "7"
    status, body = server.post(
        "/update_weights_from_disk", {"model_path": str(models["base"]), "weight_version": 8}
    )
    assert status == 400 and body["object"] == "error" and version(server) == "7"
    status, body = server.post("/update_weights_from_disk", {})
    assert status == 400 and body["object"] == "error"
    server.post("/update_weight_version", {"new_version": "default"})


def test_update_weight_version(server):
    # srt/entrypoints/http_server.py:1527-1556, srt/managers/io_struct.py:2155-2159
    assert server.post("/update_weight_version", {"new_version": "v9"}) == (
        200,
        {"success": True, "message": "Weight version updated to v9", "new_version": "v9"},
    )
    assert version(server) == "v9"
    assert gen(server)[1]["meta_info"]["weight_version"] == "v9"
    server.post("/update_weight_version", {"new_version": "default"})


def test_weight_update_session_rules(server):
    # srt/managers/scheduler_components/weight_updater.py:309-340 (begin/end texts) and
    # :187-197 (a distributed update outside a session), srt/entrypoints/http_server.py:
    # 1458-1504 ({success, message}, 200 or 400).
    upd = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
           "group_name": "g"}  # fmt: skip
    status, res = server.post("/update_weights_from_distributed", upd)
    if isinstance(server, HfServer):
        # The hf server also speaks 0.5.10.post1, which has no session (srt/managers/
        # scheduler_update_weights_mixin.py:73-85 there): outside one, an update is a
        # session of its own and gets as far as the group (test_areal_xccl_sync...).
        assert status == 400 and res["message"].startswith("Failed to receive weights: Group g")
    else:
        assert (status, res) == (400, {
            "success": False,
            "message": "update_weights_from_distributed must run between "
            "begin_weight_update() and end_weight_update()",
        })  # fmt: skip
    assert server.post("/end_weight_update", {}) == (400, {
        "success": False,
        "message": "no weight-update session is open; call begin_weight_update() first",
    })  # fmt: skip
    assert server.post("/begin_weight_update", {}) == (200, {"success": True, "message": "Success"})
    assert server.post("/begin_weight_update", {}) == (400, {
        "success": False,
        "message": "a weight-update session is already open; call end_weight_update() first",
    })  # fmt: skip
    # srt/model_executor/model_runner_components/weight_updater.py:271-275: an unknown group.
    status, res = server.post("/update_weights_from_distributed", upd)
    assert status == 400 and res["message"].startswith("Failed to receive weights: Group g not in")
    assert server.post("/end_weight_update", {}) == (200, {"success": True, "message": "Success"})


def test_areal_xccl_sync_without_a_session_installs_each_bucket(server, models):
    # 0.5.10.post1 behaviour only (the SGLang AReaL 1.0.4 pins): an update loads at once,
    # with no begin/end session (srt/managers/scheduler_update_weights_mixin.py:73-85 at
    # tag v0.5.10.post1). 0.5.23 refuses it (srt/managers/scheduler_components/
    # weight_updater.py:187-197; test_weight_update_session_rules), so the real engine of
    # this tier is not asked. AReaL's rank 0 (areal/engine/fsdp_engine.py:1266-1320,
    # 1380-1466) pauses, sends each bucket as a request of its own while it broadcasts the
    # bucket's tensors, then continues; the served weights become the sent ones.
    if not isinstance(server, HfServer):
        pytest.skip("0.5.10.post1 protocol: SGLang 0.5.23 requires a begin/end session")
    # What the other weights answer, loaded from disk; then the base weights back.
    areal_gen = areal_requests.generate(PROMPT, 6)
    assert server.post("/update_weights_from_disk", {"model_path": str(models["other"])})[0] == 200
    want = server.post("/generate", areal_gen)[1]["output_ids"]
    assert server.post("/update_weights_from_disk", {"model_path": str(models["base"])})[0] == 200
    before = server.post("/generate", areal_gen)[1]["output_ids"]
    assert before != want  # else the test proves nothing
    updates = server.get("/server_info")[1]["weight_updates"]
    res = subprocess.run([sys.executable, str(AREAL_SENDER), server.url, str(models["other"]),
                          "areal_xccl"], capture_output=True, text=True,
                         timeout=180)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    replies = json.loads(res.stdout.strip().splitlines()[-1])
    assert replies["init"][0] == 200 and replies["pause"][0] == 200
    assert (
        replies["buckets"]
        == [[200, {"success": True, "message": "Succeeded to update parameter online."}]] * 2
    )
    assert replies["resume"][0] == 200 and replies["destroy"][0] == 200
    after = server.post("/generate", areal_gen)[1]["output_ids"]
    assert after == want
    info = server.get("/server_info")[1]
    assert info["weight_updates"] == updates + 2 and not info["weight_update"]["session_open"]
    # The base weights back for the tests after this one.
    assert server.post("/update_weights_from_disk", {"model_path": str(models["base"])})[0] == 200


def test_areal_disk_update_request(server, models):
    # areal/engine/sglang_remote.py:147-158: model_path and abort_all_requests, no version.
    was = version(server)
    status, res = server.post(
        "/update_weights_from_disk", areal_requests.update_from_disk(models["base"])
    )
    assert (status, res["success"]) == (200, True) and version(server) == was


def test_destroying_an_unknown_group(server):
    # srt/model_executor/model_runner_components/weight_updater.py:146-157
    assert server.post("/destroy_weights_update_group", {"group_name": "nope"}) == (
        400,
        {"success": False, "message": "The group to be destroyed does not exist."},
    )


def test_init_group_takes_a_port_sent_as_a_string(server, models):
    # AReaL 1.0.4 sends master_port as str(port) (areal/engine/sglang_remote.py:199-207).
    # master_port: int (srt/managers/io_struct.py:2126-2138; 0.5.10.post1 :1377-1389) is
    # validated by pydantic in lax mode (0.5.23: srt/utils/msgspec_utils.py:70-118), which
    # turns "29500" into 29500: the group forms and the trainer's rendezvous completes.
    res = subprocess.run([sys.executable, str(AREAL_SENDER), server.url, str(models["other"]),
                          "areal_str_port", "init"], capture_output=True, text=True,
                         timeout=180)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    replies = json.loads(res.stdout.strip().splitlines()[-1])
    assert replies["init"] == [
        200,
        {"success": True, "message": "Succeeded to initialize custom process group."},
    ]
    assert replies["destroy"][0] == 200
    # The same lax rules refuse what pydantic refuses: a port that is no integer.
    bad = areal_requests.init_group(1, "never")
    bad["master_port"] = "twelve"
    status, body = server.post("/init_weights_update_group", bad)
    assert status == 400 and body["object"] == "error" and "master_port" in body["message"]


def test_init_group_needs_its_fields(server):
    # srt/managers/io_struct.py:2126-2138: master_address, master_port, rank_offset and
    # world_size are required; pydantic answers 400 with the ErrorResponse body.
    status, body = server.post("/init_weights_update_group", {"master_address": "127.0.0.1"})
    assert status == 400 and body["object"] == "error" and body["type"] == "Bad Request"


# -- auth --------------------------------------------------------------------------------------


def test_api_key_spares_only_probes(models, tmp_path):
    # srt/utils/auth.py:96-103 (health, ready and metrics are always allowed) and :192-203
    # ({"error": "Unauthorized"}, 401).
    with HfServer(models["base"], tmp_path, "--api-key", "k") as srv:
        srv.wait_healthy()
        assert srv.get("/ready")[0] == 200 and srv.get("/health_generate")[0] == 200
        assert srv.get("/model_info") == (401, {"error": "Unauthorized"})
        assert srv.post("/pause_generation", {}) == (401, {"error": "Unauthorized"})
        ok = srv.get("/model_info", headers={"Authorization": "Bearer k"})
        assert ok[0] == 200


def test_health_generates_so_a_paused_idle_server_is_unhealthy(models, tmp_path, monkeypatch):
    # srt/entrypoints/http_server.py:721-800 with SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION
    # true by default (srt/environ.py:344): /health waits for one generated token, at most
    # SGLANG_HEALTH_CHECK_TIMEOUT seconds (http_server.py:218), then answers an empty 503.
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "1")
    with HfServer(models["base"], tmp_path) as srv:
        srv.wait_healthy()
        assert srv.post("/pause_generation", {"mode": "retract"})[0] == 200
        started = time.monotonic()
        assert srv.get("/health") == (503, "")
        assert 0.9 < time.monotonic() - started < 5
        # The failed check flags it unhealthy (http_server.py:796-798): /ready (is_ready,
        # tokenizer_manager.py:732-734) and /ping (is_healthy, http_server.py:2189-2199) 503.
        assert srv.get("/ready") == (503, "") and srv.get("/ping") == (503, "")
        srv.post("/continue_generation", {})
        assert srv.get("/health") == (200, "")
        assert srv.get("/ready") == (200, "") and srv.get("/ping") == (200, "")


def test_the_protocol_module_speaks_this_contract(server, models):
    # What the client, the weight sync and `areal ps` send is built and read by
    # backends/protocol_sglang.py: its requests get the answers above, its parsers read them.
    from areal_cli.backends import protocol_sglang as proto

    path, body = proto.generate_request(PROMPT, proto.sampling_params(4, temperature=0))
    status, reply = server.post(path, body)
    assert status == 200
    done = proto.parse_completion(reply, "srv", None)
    assert len(done.output_ids) == len(done.logprobs) == 4 and done.finish_reason == "length"
    assert done.weight_version == version(server) and all(lp <= 0 for lp in done.logprobs)
    path, body, query = proto.pause_request(proto.PAUSE_MODES[0])
    assert query is None and server.post(path, body)[0] == 200
    assert server.post(proto.RESUME_PATH, {})[0] == 200
    for path, body in proto.disk_update_requests(str(models["base"]), "p1", False):
        assert server.post(path, body)[1]["success"] is True
    assert proto.parse_version(server.get(proto.VERSION_PATHS[0])[1]) == "p1"
    info = proto.parse_model_info(server.get(proto.MODEL_INFO_PATHS[0])[1])
    assert Path(info["model_path"]) == Path(models["base"])
    # Readiness: its route answers a ready server at once, and the first request (sent only
    # where the warm-up is off) is one the server answers.
    assert server.get(proto.READINESS_PATH)[0] == 200 and proto.first_request() is None
    path, body = proto.first_request([proto.WARMUP_OFF_FLAG])
    status, reply = server.post(path, body)
    assert status == 200 and len(proto.parse_completion(reply, "srv", None).output_ids) == 1
    server.post("/update_weight_version", {"new_version": "default"})
