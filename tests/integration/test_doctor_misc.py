"""`areal doctor allreduce`, `check` and `mesh` through the real CLI (torchrun + gloo on CPU)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil

from areal_cli.diagnose import allreduce

AREAL = str(Path(sys.executable).parent / "areal")


# Each call tags what it starts, so a leak check counts this test's repro ranks only, not those
# of an allreduce test running beside it in another worker.
TAG = "AREAL_TEST_CALL"


def doctor(
    *args: str, env: dict | None = None, timeout: float = 120, tag: str = ""
) -> subprocess.CompletedProcess:
    env = {**(os.environ if env is None else env), TAG: tag}
    return subprocess.run(
        [AREAL, "doctor", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def repro_processes(tag: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if any("allreduce_repro.py" in c for c in (p.info["cmdline"] or [])):
            try:
                if p.environ().get(TAG) == tag:
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue  # gone, or not ours to read: not this test's rank
    return found


def test_allreduce_gloo_table_follows_the_busbw_formula():
    tag = os.urandom(8).hex()
    res = doctor(
        "allreduce",
        "--backend",
        "gloo",
        "--nproc",
        "2",
        "--sizes",
        "1K:256K",
        "--iters",
        "5",
        "--warmup",
        "1",
        tag=tag,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    rows = []
    for line in res.stdout.splitlines():
        cols = line.split()
        if len(cols) == 8 and cols[0].isdigit():
            rows.append(cols)
    assert [int(r[0]) for r in rows] == [1024 << i for i in range(9)]
    n = 2
    for size, count, dtype, redop, time_us, algbw, busbw, wrong in rows:
        assert dtype == "float32" and redop == "sum" and int(count) == int(size) // 4
        assert float(algbw) == pytest_approx(int(size) / (float(time_us) * 1e3), float(algbw))
        assert abs(float(busbw) - float(algbw) * 2 * (n - 1) / n) <= 0.0015
        assert wrong == "0"
    assert "busbw" in res.stdout and "(GB/s)" in res.stdout and "avg busbw" in res.stdout
    assert not repro_processes(tag)


def pytest_approx(expected: float, shown: float) -> float:
    """`shown` when it is `expected` rounded to the table's 3 decimals (time is rounded too)."""
    return shown if abs(shown - expected) <= max(0.0015, expected * 0.01) else expected


def test_allreduce_forced_hang_gives_a_verdict_and_exits_in_time():
    env = {**os.environ, allreduce.FORCE_HANG_ENV: "1"}
    tag = os.urandom(8).hex()
    # Room for two ranks to import torch and meet on a loaded machine (at 10 s they were
    # seen still importing, and nothing had hung yet; at a load of 20, 20 s was not enough).
    timeout = 45
    res = doctor(
        "allreduce",
        "--backend",
        "gloo",
        "--nproc",
        "2",
        "--sizes",
        "1K:4K",
        "--timeout",
        str(timeout),
        "--json",
        env=env,
        tag=tag,
        timeout=timeout + 120,  # in time: a run that outlived its timeout this long fails
    )
    assert res.returncode == 3, res.stdout + res.stderr
    data = json.loads(res.stdout)
    assert data["timed_out"] is True
    v = data["hang"]["verdict"]
    assert v["kind"] == "mismatched_collective" and v["odd_ranks"] == [1]
    odd = next(r for r in data["hang"]["ranks"] if r["rank"] == 1)
    assert odd["frame"]["function"] == "skip_collective"
    assert "torn down" in res.stderr
    assert not repro_processes(tag)


def test_print_script_is_the_template():
    res = doctor("allreduce", "--print-script")
    assert res.returncode == 0
    assert res.stdout == allreduce.script_path().read_text()


def test_check_json_shape(tmp_path):
    res = doctor("check", "--json", "--registry", str(tmp_path / "reg"))
    data = json.loads(res.stdout)
    names = [r["name"] for r in data["rows"]]
    for want in (
        "python",
        "torch",
        "cuda",
        "nccl",
        "gpus",
        "transformers",
        "sglang",
        "vllm",
        "py-spy",
        "/dev/shm",
        "open files",
        "registry",
        "servers",
        "leftovers",
    ):
        assert want in names
    for r in data["rows"]:
        assert r["status"] in ("pass", "warn", "fail")
        assert set(r) == {"name", "status", "detail", "fix"}
        if r["status"] != "pass":
            assert r["fix"] or r["name"] == "gpus", r
    py_spy = next(r for r in data["rows"] if r["name"] == "py-spy")
    assert py_spy["status"] == "pass" and "attach works" in py_spy["detail"]
    failed = any(r["status"] == "fail" for r in data["rows"])
    assert res.returncode == (1 if failed else 0)
    assert data["ok"] is (not failed)


def test_check_fails_on_an_unwritable_registry(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    res = doctor("check", "--json", "--registry", str(blocker / "reg"))
    assert res.returncode == 1
    row = next(r for r in json.loads(res.stdout)["rows"] if r["name"] == "registry")
    assert row["status"] == "fail" and "AREAL_REGISTRY" in row["fix"]


def test_mesh_fsdp_d2t2():
    res = doctor("mesh", "--alloc", "fsdp:d2t2", "--json")
    assert res.returncode == 0
    data = json.loads(res.stdout)
    assert data["world_size"] == 4
    assert [d["name"] for d in data["dims"]] == ["dp", "tp"]
    assert data["groups"]["tp"] == [[0, 1], [2, 3]] and data["groups"]["dp"] == [[0, 2], [1, 3]]
    res = doctor("mesh", "--alloc", "fsdp:d2t2")
    assert re.search(r"tp groups: \[0 1\]\s+\[2 3\]", res.stdout)
    res = doctor("mesh", "--alloc", "d2t2")
    assert res.returncode == 2 and "Traceback" not in res.stderr
