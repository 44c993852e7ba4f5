"""Plans for GPU hosts, and sglang/vllm argv checked against their documented flags."""

import os

import pytest

from areal_cli.errors import UsageError
from areal_cli.schedulers.local import planner
from areal_cli.spec import JobSpec, ServerRole, TrainerRole

# From `python -m sglang.launch_server --help` / the server-arguments page.
SGLANG_FLAGS = {"--model-path", "--host", "--port", "--tp-size", "--pp-size", "--random-seed",
                "--base-gpu-id", "--mem-fraction-static"}  # fmt: skip
# From `vllm serve --help` / the engine-arguments page.
VLLM_FLAGS = {"--model", "--host", "--port", "--tensor-parallel-size", "--pipeline-parallel-size",
              "--seed", "--gpu-memory-utilization", "--logprobs-mode", "--generation-config",
              "--weight-transfer-config"}  # fmt: skip


def flags(argv):
    return {a for a in argv if a.startswith("--")}


@pytest.fixture
def four_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")


def spec(backend, d, t, model, **kw):
    role = ServerRole(backend=backend, model_path=str(model), replicas=d, tp=t, python="python",
                      host=kw.pop("host", "127.0.0.1"),
                      allow_unauthenticated_control=kw.pop("allow", False))  # fmt: skip
    return JobSpec(experiment="e", trial="t", servers=role, **kw)


def test_sglang_plan_slices_gpus(tmp_path, four_gpus):
    p = planner.plan(
        spec("sglang", 2, 2, tmp_path, api_key="none"), tmp_path, str(tmp_path / "r"),
        check_packages=False,
    )  # fmt: skip
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in p.servers] == ["0,1", "2,3"]
    argv = p.servers[0].argv
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    assert flags(argv) <= SGLANG_FLAGS
    assert argv[argv.index("--tp-size") + 1] == "2" and argv[argv.index("--base-gpu-id") + 1] == "0"
    assert p.servers[0].port != p.servers[1].port


def test_vllm_plan(tmp_path, four_gpus):
    p = planner.plan(spec("vllm", 1, 4, tmp_path, host="0.0.0.0", allow=True), tmp_path,
                     tmp_path / "r", check_packages=False)  # fmt: skip
    argv = p.servers[0].argv
    assert argv[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", str(tmp_path)]
    assert flags(argv) <= VLLM_FLAGS
    # A key is generated and handed to the server in its environment, never its argv.
    assert p.api_key and p.api_key not in argv and "--api-key" not in argv
    assert p.servers[0].env["VLLM_API_KEY"] == p.api_key


def test_auto_key_on_loopback_too_and_none_opts_out(tmp_path):
    p = planner.plan(spec("hf", 1, 1, tmp_path), tmp_path, str(tmp_path / "r"),
                     check_packages=False)  # fmt: skip
    assert p.api_key and p.servers[0].env["AREAL_SERVER_API_KEY"] == p.api_key
    assert p.api_key not in p.servers[0].argv
    p = planner.plan(spec("hf", 1, 1, tmp_path, api_key="none"), tmp_path, str(tmp_path / "r"),
                     check_packages=False)  # fmt: skip
    assert p.api_key is None and "AREAL_SERVER_API_KEY" not in p.servers[0].env


def test_fewer_gpus_than_planned(tmp_path, four_gpus):
    with pytest.raises(UsageError, match="needs 8 GPUs"):
        planner.plan(
            spec("sglang", 4, 2, tmp_path), tmp_path, str(tmp_path / "r"), check_packages=False
        )


def test_no_gpu_runs_the_engines_cpu_builds(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    for backend, var in (
        ("vllm", "VLLM_CPU_OMP_THREADS_BIND"),
        ("sglang", "SGLANG_USE_CPU_ENGINE"),
    ):
        p = planner.plan(
            spec(backend, 2, 1, tmp_path), tmp_path, str(tmp_path / "r"), check_packages=False
        )
        # No fake GPUs: each replica pinned to cores of its own, no two on core 0.
        assert [s.gpus for s in p.servers] == [[], []]
        assert [s.cpus for s in p.servers] == [[0, 1], [2, 3]]
        assert all(var in s.env and s.env["CUDA_VISIBLE_DEVICES"] == "" for s in p.servers)
    assert [s.env[var] for s in p.servers] == ["1", "1"]
    p = planner.plan(
        spec("hf", 2, 1, tmp_path), tmp_path, str(tmp_path / "r"), check_packages=False
    )
    assert all(s.gpus == [] and s.cpus == [] and "--device" in s.argv for s in p.servers)


def test_trainer_takes_gpus_no_server_holds(tmp_path, four_gpus):
    from areal_cli import settings
    from areal_cli.registry import FileRegistry, ServerEntry

    FileRegistry(tmp_path / "r").register(ServerEntry(
        id="x", addr="127.0.0.1:1", experiment="other", trial="t", host=settings.hostname(),
        pid=os.getpid(), gpus=[0, 1]))  # fmt: skip
    t = TrainerRole(script="train.py", script_args=("--config", "c.yaml"), nproc=2, alloc="fsdp:d2")
    s = JobSpec(experiment="e", trial="t", trainer=t, external_servers=("127.0.0.1:1",),
                external_backend="sglang")  # fmt: skip
    p = planner.plan(s, tmp_path, str(tmp_path / "r"))
    (tr,) = p.trainers
    assert tr.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert tr.env["NCCL_CUMEM_ENABLE"] == "0" and tr.env["AREAL_LLM_SERVER_ADDRS"] == "127.0.0.1:1"
    t3 = TrainerRole(script="train.py", script_args=(), nproc=3, alloc="fsdp:d3")
    with pytest.raises(UsageError, match="GPU 0: other/t"):
        planner.plan(JobSpec(experiment="e", trial="t", trainer=t3), tmp_path, str(tmp_path / "r"))


def test_gpus_and_ports_of_jobs_still_starting_are_taken(tmp_path, four_gpus):
    from areal_cli import procs, settings
    from areal_cli.schedulers.local import records as jobs

    rec = jobs.JobRecord(
        experiment="other", trial="t", kind="serve", state="starting", marker="m",
        supervisor_pid=os.getpid(), supervisor_create_time=procs.create_time(os.getpid()),
        host=settings.hostname(), started=0.0, log_dir="/tmp", registry="/tmp",
        processes=[jobs.ProcessRecord(role="server", index=0, pid=os.getpid(), argv=[], log="",
                                      addr="127.0.0.1:30000", gpus=[0, 1])],
    )  # fmt: skip
    jobs.write(tmp_path, rec)
    p = planner.plan(
        spec("sglang", 1, 2, tmp_path), tmp_path, str(tmp_path / "r"), check_packages=False
    )
    assert p.servers[0].gpus == [2, 3] and p.servers[0].port != 30000


def test_a_plan_reads_the_parsed_allocation_and_the_opened_registry(tmp_path, monkeypatch):
    """Parse once, open once: the planner takes the command's parsed allocation and its
    registry object, and neither parses --alloc again nor opens another registry."""
    from areal_cli import alloc, registry
    from areal_cli.registry import FileRegistry
    from areal_cli.schedulers import common

    allocation = alloc.parse("fsdp:d2t2")
    reg = FileRegistry(tmp_path / "r")

    def refuse(*a, **kw):
        raise AssertionError("parsed or opened again")

    monkeypatch.setattr(alloc, "parse", refuse)
    monkeypatch.setattr(registry, "open_registry", refuse)
    monkeypatch.setattr(common, "open_registry", refuse)
    monkeypatch.setattr(planner, "open_registry", refuse, raising=False)
    t = TrainerRole(script="train.py", script_args=(), nproc=4, alloc=allocation.text,
                    areal_overrides=True)  # fmt: skip
    s = JobSpec(experiment="e", trial="t", trainer=t, alloc=allocation.text,
                allocation=allocation, external_servers=("127.0.0.1:1",),
                external_backend="sglang")  # fmt: skip
    p = planner.plan(s, tmp_path, reg)
    (tr,) = p.trainers
    assert p.registry == reg.url and tr.env["AREAL_REGISTRY"] == reg.url
    assert tr.env["AREAL_MESH"] == "pp=1,dp=2,cp=1,tp=2"
    assert s.world_size == 4
