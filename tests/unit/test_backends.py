"""Server command lines and environments against sglang 0.5.23's and vllm 0.32/0.33's own
flags, on GPUs and on a host without them (the engines' CPU builds)."""

from __future__ import annotations

import pytest

from areal_cli import backends
from areal_cli.errors import UsageError
from areal_cli.spec import ServerRole
from tests.helpers import areal

# sglang 0.5.23: one flag per field, "--" + name with "-" for "_"
# (srt/arg_groups/arg_utils.py:288-290): model_path (fields/model.py:51-57), host and port
# (fields/serving.py:65-66), tp_size (fields/parallel.py:45-51), pp_size (:59-65),
# random_seed (fields/device.py:47), base_gpu_id (:28-31), mem_fraction_static
# (fields/schedule.py:27-30), revision (fields/model.py); never api_key (fields/serving.py:160):
# a key goes in the YAML of --config (server_args.py:400-405), see test_sglang_key_*.
SGLANG_FLAGS = {"--model-path", "--host", "--port", "--tp-size", "--pp-size", "--random-seed",
                "--base-gpu-id", "--mem-fraction-static", "--revision"}  # fmt: skip
# vllm 0.33: engine/arg_utils.py:978 (--seed), :1010 (--logprobs-mode), :1041
# (--generation-config), :1171 (--pipeline-parallel-size), :1209 (--tensor-parallel-size),
# :1389 (--gpu-memory-utilization), :1915 (--weight-transfer-config); --host, --port from the
# OpenAI server's arguments. Never --api-key: the key is VLLM_API_KEY (envs.py:829).
VLLM_FLAGS = {"--model", "--host", "--port", "--tensor-parallel-size",
              "--pipeline-parallel-size", "--seed", "--gpu-memory-utilization", "--logprobs-mode",
              "--generation-config", "--weight-transfer-config", "--revision"}  # fmt: skip
# sglang 0.5.23 on CPU: device (fields/device.py), attention_backend, sampling_backend,
# grammar_backend, cuda_graph_backend_decode/prefill, dtype, max_total_tokens,
# max_running_requests, chunked_prefill_size (srt/arg_groups/fields/*.py, checked against
# the installed engine in tests/engines/).
SGLANG_CPU_FLAGS = {"--device", "--attention-backend", "--sampling-backend", "--grammar-backend",
                    "--cuda-graph-backend-decode", "--cuda-graph-backend-prefill", "--dtype",
                    "--max-total-tokens", "--max-running-requests", "--chunked-prefill-size"}  # fmt: skip


def role(backend: str, **kw) -> ServerRole:
    return ServerRole(backend=backend, model_path="/models/m", replicas=1, python="python", **kw)


def flags(argv: list[str]) -> set[str]:
    return {a for a in argv if a.startswith("--")}


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_sglang_argv_uses_only_its_flags():
    argv = backends.get("sglang").argv(role("sglang", tp=2, pp=2), 30000, None, True)
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    assert flags(argv) <= SGLANG_FLAGS
    assert value(argv, "--tp-size") == "2" and value(argv, "--pp-size") == "2"
    assert backends.get("sglang").env(role("sglang")) == {}


def test_sglang_key_goes_through_the_launcher_and_the_environment():
    sglang = backends.get("sglang")
    argv = sglang.argv(role("sglang"), 30000, "k3y", True)
    assert "k3y" not in argv and "--api-key" not in argv
    launcher, server = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    assert launcher[1:] == ["-m", "areal_cli.backends.sglang_launch"]
    assert server[:3] == ["python", "-m", "sglang.launch_server"] and flags(server) <= SGLANG_FLAGS
    assert sglang.env(role("sglang"), "k3y") == {"AREAL_SERVER_API_KEY": "k3y"}


@pytest.mark.parametrize("name, var", [("hf", "AREAL_SERVER_API_KEY"), ("vllm", "VLLM_API_KEY")])
def test_hf_and_vllm_keys_only_in_the_environment(name, var):
    b = backends.get(name)
    argv = b.argv(role(name), 8000, "k3y", True)
    assert "k3y" not in argv and "--api-key" not in argv
    assert b.env(role(name), "k3y")[var] == "k3y"


def test_vllm_argv_and_env_for_a_trained_server():
    vllm = backends.get("vllm")
    argv = vllm.argv(role("vllm", tp=2), 8000, None, True)
    # entrypoints/launchers/api_server/entry.py `main`: any distribution of vLLM has it
    # (the `vllm` command needs one named "vllm", entrypoints/cli/main.py:99).
    assert argv[:5] == [
        "python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/models/m",
    ]
    assert flags(argv) <= VLLM_FLAGS
    # config/model.py:291 (raw_logprobs by default: before temperature), :358-364
    # (generation_config.json would change sampling defaults).
    assert value(argv, "--logprobs-mode") == "processed_logprobs"
    assert value(argv, "--generation-config") == "vllm"
    # v1/worker/gpu_worker.py:1512-1517: no engine without a weight-transfer config.
    assert value(argv, "--weight-transfer-config") == '{"backend": "nccl"}'
    # entrypoints/launchers/api_server/routers.py:46-53: control routes need dev mode.
    assert vllm.env(role("vllm")) == {"VLLM_SERVER_DEV_MODE": "1"}


def test_vllm_flags_the_user_gives_win():
    r = role("vllm", extra_args=("--logprobs-mode", "raw_logprobs", "--generation-config=auto"))
    argv = backends.get("vllm").argv(r, 8000, None, True)
    assert argv.count("--logprobs-mode") == 1 and value(argv, "--logprobs-mode") == "raw_logprobs"
    assert "--generation-config" not in argv and "--generation-config=auto" in argv


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_vllm_on_loopback_binds(host):
    backends.get("vllm").check_bind(role("vllm", host=host))


def test_vllm_beyond_loopback_needs_the_explicit_flag():
    vllm = backends.get("vllm")
    with pytest.raises(UsageError) as info:
        vllm.check_bind(role("vllm", host="0.0.0.0"))
    # entrypoints/serve/middleware/authenticate.py:11: what --api-key leaves open.
    assert "--api-key does not cover them" in info.value.message
    assert "--allow-unauthenticated-control" in info.value.hint
    vllm.check_bind(role("vllm", host="0.0.0.0", allow_unauthenticated_control=True))
    backends.get("sglang").check_bind(role("sglang", host="0.0.0.0"))


def test_serve_refuses_with_exit_2_and_the_reason(tmp_path):
    args = ["serve", "--backend", "vllm", "--model", str(tmp_path), "--host", "0.0.0.0",
            "--gpus", "0", "--dry-run"]  # fmt: skip
    res = areal(*args)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "would let anyone who reaches it pause it" in res.stderr
    ok = areal(*args, "--allow-unauthenticated-control", "--json")
    assert ok.returncode == 0, ok.stderr
    assert "VLLM_SERVER_DEV_MODE" in ok.stdout
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("allow_unauthenticated_control: true\n")
    assert areal(*args, "--config", str(cfg)).returncode == 0


def test_sglang_on_cpu_runs_its_cpu_engine():
    sglang = backends.get("sglang")
    argv = sglang.argv(role("sglang", extra_args=("--dtype", "bfloat16")), 30000, None, False)
    assert flags(argv) <= (SGLANG_FLAGS | SGLANG_CPU_FLAGS) - {"--base-gpu-id"}
    assert value(argv, "--device") == "cpu" and value(argv, "--attention-backend") == "torch_native"
    assert "--mem-fraction-static" not in argv  # the KV pool comes from --max-total-tokens
    assert argv.count("--dtype") == 1 and value(argv, "--dtype") == "bfloat16"  # the user's wins
    # srt/utils/common.py:221-224: the CPU engine only with this variable.
    env = sglang.env(role("sglang"), "k3y", on_gpu=False, cores=[2, 3])
    assert env == {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "2",
                   "AREAL_SERVER_API_KEY": "k3y"}  # fmt: skip


def test_vllm_on_cpu_binds_each_replica_and_each_rank_to_its_cores():
    vllm = backends.get("vllm")
    argv = vllm.argv(role("vllm"), 8000, None, False)
    assert "--gpu-memory-utilization" not in argv and value(argv, "--dtype") == "float32"
    env = vllm.env(role("vllm"), None, on_gpu=False, cores=[4, 5, 6, 7])
    # envs.py:887 (GiB of KV cache), utils/ompmultiprocessing.py:122-167 ("|" per TP rank).
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "4-7"
    tp2 = vllm.env(role("vllm", tp=2), None, on_gpu=False, cores=[0, 1, 2, 5])
    assert tp2["VLLM_CPU_OMP_THREADS_BIND"] == "0-1|2,5"


def test_cpu_cores_are_split_between_replicas():
    assert backends.cpu_slices(2, [0, 1, 2, 3, 4]) == [[0, 1, 2], [3, 4]]
    assert backends.cpu_slices(2, [0, 1]) == [[0], [1]]
    assert backends.cpu_slices(3, [0, 1]) == [[0], [1], [0]]  # more replicas than cores
    assert backends.cpu_slices(1) == [sorted(__import__("os").sched_getaffinity(0))]


def _fake_engines(root):
    """Importable `sglang` and `vllm` packages of a GPU build: vllm's distribution is "vllm",
    and no sgl_kernel exists."""
    for name in ("sglang", "vllm"):
        (root / name).mkdir()
        (root / name / "__init__.py").write_text("")
    info = root / "vllm-0.33.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n")
    (info / "top_level.txt").write_text("vllm\n")


@pytest.mark.parametrize("name, why", [
    ("sglang", "its sgl_kernel has no CPU build"),
    ("vllm", "its vLLM is not the CPU build (vllm 0.33.0)"),
])  # fmt: skip
def test_an_engine_without_a_cpu_build_is_refused_on_a_host_without_gpus(
    tmp_path, monkeypatch, name, why
):
    import sys

    _fake_engines(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    backend = backends.get(name)
    backends.check_installed(backend, sys.executable, on_gpu=True)  # a GPU host: fine
    with pytest.raises(UsageError) as info:
        backends.check_installed(backend, sys.executable, on_gpu=False)
    assert (
        f"this host has no GPU, and {name} in {sys.executable} cannot run on CPU"
        in (info.value.message)
        and why in info.value.message
    )
    assert "make engines" in info.value.hint and backends.engine_python(name) in info.value.hint


def test_readiness_and_the_first_request_come_from_the_engines_protocol():
    from areal_cli.backends import protocol_sglang, protocol_vllm

    sglang, vllm, hf = (backends.get(n) for n in ("sglang", "vllm", "hf"))
    # SGLang's /ready is 200 only once its own warm-up generation was answered
    # (srt/entrypoints/http_server.py:2490-2502): no generation of ours on top of it...
    assert sglang.ready_path == "/ready" and sglang.first_request(role("sglang")) is None
    # ...unless its warm-up is off (:2589-2593): then one, as the client would send it.
    off = role("sglang", extra_args=("--skip-server-warmup",))
    path, body = protocol_sglang.generate_request([0], protocol_sglang.sampling_params(1, 0.0))
    assert sglang.first_request(off) == [path, body] == ["/generate", body]
    assert body["sampling_params"]["max_new_tokens"] == 1 and body["input_ids"] == [0]
    # vLLM's /health says nothing of a forward pass: one completion, spoken as 0.32 speaks.
    assert vllm.ready_path == "/health"
    path, body = vllm.first_request(role("vllm"))
    assert (path, body) == protocol_vllm.first_request()
    assert path == "/v1/completions" and body["max_tokens"] == 1 and body["prompt"] == [0]
    assert "return_weight_versions" not in body
    assert hf.ready_path == "/health" and hf.first_request(role("hf")) is None


def _counting_sglang(root, counter):
    """An importable sglang whose sgl_kernel has a CPU helper and counts its imports."""
    for name in ("sglang", "sgl_kernel"):
        (root / name).mkdir(parents=True)
    (root / "sglang" / "__init__.py").write_text("")
    (root / "sgl_kernel" / "__init__.py").write_text(
        f"open({str(counter)!r}, 'a').write('x')\ndef assign_req_to_token_pool_cpu(): pass\n"
    )


def test_a_passed_cpu_probe_is_remembered_until_the_engines_packages_change(tmp_path, monkeypatch):
    import os
    import sys

    counter = tmp_path / "imports"
    _counting_sglang(tmp_path / "site", counter)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("AREAL_HOME", str(tmp_path / "home"))
    sglang = backends.get("sglang")
    for _ in range(3):
        backends.check_installed(sglang, sys.executable, on_gpu=False)
    # The probe imports torch with the engine's kernels (2 s and more): once.
    assert counter.read_text() == "x"
    kernel = tmp_path / "site" / "sgl_kernel" / "__init__.py"
    kernel.write_text(kernel.read_text() + "# rebuilt\n")
    os.utime(kernel, ns=(1, 1))
    backends.check_installed(sglang, sys.executable, on_gpu=False)
    assert counter.read_text() == "xx"  # the kernels changed: asked again
    # A failed probe is not remembered: the venv fixed, the next serve sees it.
    kernel.write_text("raise ImportError('libcuda.so.1: cannot open shared object file')\n")
    for _ in range(2):
        with pytest.raises(UsageError, match="cannot run on CPU"):
            backends.check_installed(sglang, sys.executable, on_gpu=False)


def test_serve_without_gpus_names_what_to_install(tmp_path):
    # The repository's own interpreter has no engine: one message, exit 2, no traceback.
    import sys

    res = areal("serve", "--backend", "sglang", "--model", str(tmp_path), "--python",
                sys.executable, env={"CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "cannot import" in res.stderr and "make engines" in res.stderr


def test_a_generated_key_never_looks_like_a_flag(monkeypatch):
    # SGLang gets its key back on argv (server_args_config_parser.py `_add_scalar_arg`:
    # ["--api-key", value]); argparse takes "-..." for a flag and the server exits 2.
    import secrets

    from areal_cli.schedulers.common import resolve_api_key

    draws = iter(["-starts-with-a-dash", "_fine-key"])
    monkeypatch.setattr(secrets, "token_urlsafe", lambda n: next(draws))
    assert resolve_api_key("auto") == "_fine-key"


@pytest.mark.parametrize("name", ["sglang", "vllm", "hf"])
@pytest.mark.parametrize("api_key", [None, "k"])
def test_each_engine_knows_the_command_lines_it_plans(name, api_key):
    # `areal ps` tells a job's servers by their recorded argv (control.backend_of): the argv
    # an engine plans, with or without a key (SGLang's then starts through our launcher).
    from areal_cli import control

    engine = backends.get(name)
    for on_gpu in (True, False):
        argv = engine.argv(role(name), 30000, api_key, on_gpu=on_gpu)
        assert control.backend_of(argv) == name, argv
        assert control.backend_of(engine.node_argv(argv)) == name
    assert control.backend_of(["python", "-m", "http.server"]) is None


def test_engines_are_told_apart_by_their_answers():
    # /server_info as each answers it (hf names itself; vLLM's dev mode has its config;
    # SGLang gives its launch arguments), else who /v1/models says owns the models.
    assert backends.identify({"backend": "hf", "model_path": "m"}, None) == "hf"
    assert backends.identify({"vllm_config": {}}, None) == "vllm"
    assert backends.identify({"model_path": "m", "tp_size": 1}, None) == "sglang"
    assert backends.identify(None, {"vllm"}) == "vllm"
    assert backends.identify(None, {"vllm", "someone"}) is None
    assert backends.identify(None, None) is None


def test_the_features_the_core_asks_for():
    sglang, vllm, hf = (backends.get(n) for n in ("sglang", "vllm", "hf"))
    assert backends.default_for(True) == "sglang" and backends.default_for(False) == "hf"
    # The reference engine speaks SGLang's protocol: AReaL takes it for SGLang.
    assert hf.protocol is sglang.protocol is not vllm.protocol
    assert hf.areal_engine == sglang.areal_engine == "sglang" and vllm.areal_engine == "vllm"
    assert not hf.multi_gpu_replica and sglang.multi_gpu_replica and vllm.multi_gpu_replica
    assert "NCCL_CUMEM_ENABLE" in sglang.trainer_env() and not vllm.trainer_env()
    # One server over two nodes: SGLang's flags on every node, vLLM's followers headless.
    assert sglang.multi_node_argv(role("sglang"), ["x"], 2)[1] == []
    assert vllm.multi_node_argv(role("vllm"), ["x"], 2)[1] == ["--headless"]
    with pytest.raises(UsageError, match="hf cannot run one server over several nodes"):
        hf.multi_node_argv(role("hf"), ["x"], 2)
    # An unknown name (a record any engine may have written) is the fallback's protocol.
    assert backends.find("nope") is None and backends.resolve("nope").name == backends.FALLBACK
