"""`doctor profile`, `doctor memory` and `doctor diverge` on a job whose ranks run on two nodes,
on the real local Slurm cluster (nodes n1, n2) and the real two-node Ray cluster (127.0.0.2,
127.0.0.3): each node's ranks are read on that node through the scheduler (srun --overlap,
the job's actor), the profiles come back under the caller's --out, every memory row names its
node, and the check runs at one step on all four ranks. The job (cluster_doctor.py): 2 ranks
per node, the last one computing three times as long and holding a drifted weight.
"""

from __future__ import annotations

import json
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.helpers import AREAL, areal

JOB = str(Path(__file__).with_name("cluster_doctor.py"))


def wait_ranks(reg, proc, n: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while len(reg.ranks("default", "trial0")) < n:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "the ranks did not register"
        time.sleep(0.5)
    time.sleep(2)  # past the first steps


def doctor_all_three(tmp_path: Path, nodes: set[str]) -> None:
    # memory: a row per rank, each with its node, each node's memory beside them
    snaps = tmp_path / "snap"
    res = areal("doctor", "memory", "--job", "default/trial0", "--json", "--snapshot",
                str(snaps), timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    mem = json.loads(res.stdout)
    node_of = {r["rank"]: r["node"] for r in mem["ranks"]}
    assert sorted(node_of) == [0, 1, 2, 3] and set(node_of.values()) == nodes, mem
    assert all(r["rss"] > 50 << 20 and r["channel"] is None for r in mem["ranks"])
    assert set(mem["nodes"]) == nodes and mem["errors"] == {}
    assert all(v["host"]["total"] > 0 for v in mem["nodes"].values())
    assert mem["most"]["node"] == node_of[mem["most"]["rank"]]
    # each rank's snapshot (on CPU: its RSS breakdown) brought back from its node
    assert sorted((s["rank"], s["node"], s["kind"]) for s in mem["snapshots"]) == [
        (r, n, "smaps_rollup") for r, n in sorted(node_of.items())
    ]
    for r, n in node_of.items():
        assert json.loads((snaps / f"rank{r}-{n}.smaps_rollup.json").read_text())["Rss"] > 0
    # profile: recorded on both nodes at once, files written here, the straggler named
    out = tmp_path / "prof"
    t0 = time.monotonic()
    res = areal("doctor", "profile", "--job", "default/trial0", "--duration", "3", "--out",
                str(out), "--json", timeout=120)  # fmt: skip
    wall = time.monotonic() - t0
    assert res.returncode == 0, res.stderr
    prof = json.loads(res.stdout)
    assert prof["straggler"]["rank"] == 3, prof["straggler"]
    assert prof["straggler"]["node"] == node_of[3]
    for r in prof["ranks"]:
        assert r["error"] is None and r["node"] == node_of[r["rank"]], r
        stem = out / f"rank{r['rank']}-{r['node']}"
        assert json.loads(Path(f"{stem}.speedscope.json").read_text())["profiles"]
        assert len(ET.parse(f"{stem}.svg").getroot()) > 3
    assert wall < 3 + 25, wall
    # diverge: one step for all four ranks, the drifted one named with its node
    res = areal("doctor", "diverge", "--job", "default/trial0", "--json", timeout=180)
    assert res.returncode == 1, res.stdout + res.stderr
    div = json.loads(res.stdout)
    assert div["ranks"] == [0, 1, 2, 3] and div["not_reached"] == [], div
    weight = next(m for m in div["mismatches"] if m["name"] == "weight")
    assert weight["ranks"] == [3] and weight["nodes"] == [node_of[3]]
    assert div["nodes"] == {str(r): n for r, n in node_of.items()}
    text = areal("doctor", "diverge", "--job", "default/trial0", timeout=180).stdout
    assert f"rank(s) 3 (node {node_of[3]}) differ" in " ".join(text.split()), text


@pytest.mark.usefixtures("slurm_env")
def test_profile_memory_diverge_across_slurm_nodes(slurm_env, areal_env, tmp_path):
    from areal_cli.registry import open_registry

    proc = subprocess.Popen(
        [AREAL, "train", "--scheduler", "slurm", "--alloc", "fsdp:d4", "--gpus-per-node", "2",
         "--servers", "none", JOB],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_ranks(open_registry(str(areal_env[1])), proc, 4)
        doctor_all_three(tmp_path, {"n1", "n2"})
    finally:
        areal("stop", "default/trial0", check=0, timeout=120)
        proc.wait(timeout=120)


@pytest.mark.usefixtures("ray_env")
def test_profile_memory_diverge_across_ray_nodes(ray_cluster, areal_env, tmp_path):
    from areal_cli.registry import open_registry

    proc = subprocess.Popen(
        [AREAL, "train", "--scheduler", "ray", "--alloc", "fsdp:d4", "--nnodes", "2",
         "--servers", "none", JOB],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_ranks(open_registry(str(areal_env[1])), proc, 4)
        doctor_all_three(tmp_path, set(ray_cluster.nodes))
    finally:
        areal("stop", "default/trial0", check=0, timeout=120)
        proc.wait(timeout=120)


def test_a_node_that_cannot_be_reached_is_named(tmp_path):
    """The scheduler reaches node a (its node-side entry runs for real) but not node b: memory
    and profile give node a's rank and name node b's failure; diverge arms nothing."""
    import os
    import sys

    from areal_cli.diagnose import diverge, memory, profile
    from areal_cli.diagnose.targets import Job, RankProc
    from areal_cli.errors import ArealError

    down = "node b cannot be reached: it is down"
    rank0 = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"},
    )

    def reach(job_id, commands, timeout):
        out = {"b": (None, down)}
        res = subprocess.run(commands["a"], capture_output=True, text=True, timeout=timeout)
        out["a"] = (res.stdout, None)
        return out

    try:
        job = Job(
            label="job e/t", name="e/t", scheduler_job_id="7", reach=reach,
            ranks=[RankProc(rank0.pid, 0, 0, 2, None, [], node="a"),
                   RankProc(4194001, 1, 0, 2, None, [], node="b")],
            nodes={"a": [rank0.pid], "b": [4194001]},
        )  # fmt: skip
        mem = memory.gather(job)
        assert [(r.rank, r.node) for r in mem.ranks] == [(0, "a")] and mem.errors == {"b": down}
        prof = profile.record(job, tmp_path / "p", duration=1)
        by_rank = {t.rank: t for t in prof.ranks}
        assert by_rank[1].error == down and by_rank[1].node == "b"
        assert by_rank[0].error is None and (tmp_path / "p" / "rank0-a.svg").exists()
        with pytest.raises(ArealError, match=down):
            diverge.run(job)
    finally:
        rank0.kill()
        rank0.wait()
