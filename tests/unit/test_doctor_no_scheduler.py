"""The doctor imports no scheduler: it is handed a job record and a way to reach the job's nodes
(areal_cli.schedulers.doctor_targets does the handing). Read from the source with `ast`, every
import counts, the ones inside functions too; then the seam itself, on real processes."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

DIAGNOSE = REPO / "src" / "areal_cli" / "diagnose"


def _imported(path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, relative ones made absolute, and of every
    importlib.import_module / __import__ call given a constant name."""
    package = "areal_cli.diagnose"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Call) and node.args:
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            arg = node.args[0]
            if name in ("import_module", "__import__") and isinstance(arg, ast.Constant):
                out.append((node.lineno, str(arg.value)))
    return out


def test_no_module_of_the_doctor_imports_a_scheduler():
    files = sorted(DIAGNOSE.rglob("*.py"))
    assert len(files) > 20  # the census reads the real folder
    bad = [f"{p.relative_to(REPO)}:{line}: {mod}" for p in files for line, mod in _imported(p)
           if mod == "areal_cli.schedulers" or mod.startswith("areal_cli.schedulers.")]  # fmt: skip
    assert bad == []


def test_the_census_sees_imports_inside_functions_and_relative_ones(tmp_path):
    src = tmp_path / "x.py"
    src.write_text(
        "def f():\n    from areal_cli import schedulers\n"
        "def g():\n    from ..schedulers import api\n"
        "import importlib\nimportlib.import_module('areal_cli.schedulers.local')\n"
    )
    assert sorted(m for _, m in _imported(src)) == [
        "areal_cli.schedulers",
        "areal_cli.schedulers.api",
        "areal_cli.schedulers.local",
        "importlib",
    ]


RANK = "import time\nwhile True: time.sleep(0.2)\n"


@pytest.fixture
def rank():
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    p = subprocess.Popen([sys.executable, "-c", RANK], env=env)
    yield p
    p.kill()
    p.wait()


def _record(tmp_path, pids, state="running", job_id=None, nodes=()):
    from areal_cli.schedulers.api import Handle, JobStatus

    handle = Handle("local", "e", "t", "train", job_id=job_id)
    return JobStatus(handle, state, pids=pids, nodes=list(nodes),
                     registry=str(tmp_path / "registry"), marker="m-1")  # fmt: skip


def test_a_record_without_a_way_to_reach_nodes_is_a_job_on_this_host(tmp_path, rank):
    from areal_cli.diagnose import job_ranks, targets

    # The record's pids are its supervisor's; the rank is found below it (here: itself).
    job = job_ranks.from_record(_record(tmp_path, [rank.pid]))
    assert job.name == "e/t" and not job.on_other_nodes
    assert [(r.pid, r.rank) for r in job.ranks] == [(rank.pid, 0)]
    with pytest.raises(Exception) as e:
        job.run_on_nodes(lambda n: ["true"], 1.0)
    assert "no way to reach its nodes" in str(e.value)
    assert isinstance(e.value, targets.UsageError)


def test_a_record_with_a_way_to_reach_nodes_runs_there_through_it(tmp_path):
    from areal_cli.diagnose import job_ranks, remote_call

    calls = []

    def reach(job_id, commands, timeout):  # what a scheduler's run_on_nodes does: run them
        calls.append(job_id)
        out = {}
        for node, argv in commands.items():
            env = {**os.environ, "AREAL_NODE_NAME": node}
            res = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
            out[node] = (res.stdout, None if res.returncode == 0 else res.stderr)
        return out

    record = _record(tmp_path, [], job_id="17", nodes=["n1", "n2"])
    job = job_ranks.from_record(record, reach=reach, lead=0.2, what="Cluster job 17")
    assert job.on_other_nodes and job.lead == 0.2 and set(job.nodes) == {"n1", "n2"}
    assert job.label == "job e/t (Cluster job 17, nodes n1,n2)"
    # The node side of `doctor memory` runs on each node, and finds no rank of marker m-1.
    got = remote_call.on_nodes(job, ["memory"], timeout=60.0)
    assert calls == ["17"]
    assert {n: (d["node"], d["ranks"], why) for n, (d, why) in got.items()} == {
        "n1": ("n1", [], None),
        "n2": ("n2", [], None),
    }


def test_an_ended_cluster_record_is_refused_with_its_state(tmp_path):
    from areal_cli.diagnose import job_ranks
    from areal_cli.errors import UsageError

    record = _record(tmp_path, [], state="failed", job_id="9", nodes=["n1"])
    with pytest.raises(UsageError) as e:
        job_ranks.from_record(record, reach=lambda *a: {}, what="Cluster job 9")
    assert e.value.message == "job e/t (Cluster job 9) is failed: no ranks to dump"
