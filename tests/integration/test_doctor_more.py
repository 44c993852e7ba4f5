"""`areal doctor diverge | memory | profile` and check_consistency against real torchrun jobs
(gloo on CPU): ranks on areal's worker runtime that disagree (a replicated model, a DTensor on a
dp x tp mesh) or agree (FSDP2), and three ranks of which one computes three times as long.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import psutil
import pytest
from test_doctor_hang import AREAL, MARK_PREFIX, launch, stop_all

from areal_cli import procs, settings
from areal_cli.diagnose import memory
from areal_cli.registry.api import ServerEntry
from areal_cli.registry.file import FileRegistry
from areal_cli.worker import channel

TP_MESH = {"AREAL_MESH": "pp=1,dp=2,cp=1,tp=2"}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("doctor-more")
    started = {}
    server = None
    try:
        for label, nproc, env in [
            ("replicated", 2, {"MODE": "replicated"}),
            ("tp", 4, {"MODE": "tp", **TP_MESH}),
            ("fsdp", 2, {"MODE": "fsdp"}),
            # Steps once, then stops stepping: a step named to it never comes.
            ("stalled", 2, {"MODE": "replicated", "STEP_S": "1000"}),
        ]:
            started[label] = launch("diverge_job", nproc, tmp, env=env, label=label)
        # An HTTP server the slow job's ranks are given as their inference server, recorded in
        # the registry the ranks use, as `areal serve` records its servers.
        port = procs.free_ports(1, start=54000 + 40)[0]
        server = procs.spawn(
            [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
            env={**os.environ, procs.MARKER_ENV: f"{MARK_PREFIX}server"},
            stdout=subprocess.DEVNULL,
        )
        reg = tmp / "registry"
        FileRegistry(str(reg)).register(
            ServerEntry(id="0", addr=f"127.0.0.1:{port}", experiment="e", trial="t",
                        host=settings.hostname(), pid=server.pid), ttl=600,
        )  # fmt: skip
        started["slow"] = launch(
            "slow_rank", 3, tmp, label="slow",
            env={"AREAL_LLM_SERVER_ADDRS": f"127.0.0.1:{port}", "AREAL_REGISTRY": str(reg)},
        )  # fmt: skip
        started["slow"].server_pid = server.pid
        for s in started.values():
            s.wait_alive()
        yield started
    finally:
        if server is not None:
            procs.kill_job(f"{MARK_PREFIX}server", [server.pid], grace=1.0)
            server.wait(timeout=5)
        stop_all(started.values())


def areal(*args: str, timeout: float = 90.0, home: Path | None = None):
    env = {**os.environ, **({"AREAL_HOME": str(home)} if home else {})}
    return subprocess.run(
        [AREAL, "doctor", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def reports(s, timeout: float = 120.0) -> list[dict]:
    """Each rank's own check_consistency report (the scenario writes it before stepping)."""
    paths = [s.workdir / f"report-{r}.json" for r in range(s.nproc)]
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert s.proc.poll() is None, s.log()
        assert time.monotonic() < deadline, s.log()
        time.sleep(0.1)
    time.sleep(0.2)  # written whole by then
    return [json.loads(p.read_text()) for p in paths]


def home_of(s) -> Path:
    return s.workdir.parent / "home"


def test_a_changed_parameter_on_one_replica_is_named_with_its_rank(jobs):
    s = jobs["replicated"]
    got = reports(s)
    assert got[0]["mismatches"] == got[1]["mismatches"]  # every rank gets the whole report
    mism = {m["name"]: m for m in got[0]["mismatches"]}
    # The parameter, what backward made of it, and the loss; all on rank 1.
    assert list(mism) == ["weight", "weight.grad", "bias.grad", "loss"]
    m = mism["weight"]
    assert (m["name"], m["kind"], m["dim"], m["ranks"], m["reference_rank"]) == (
        "weight", "param", "dp", [1], 0
    )  # fmt: skip
    assert m["max_abs_diff"] == pytest.approx(0.5) and m["shape"] == [8, 8]
    assert mism["weight.grad"]["kind"] == "grad" and mism["loss"]["dim"] == "world"
    assert all(x["ranks"] == [1] and x["max_abs_diff"] > 0 for x in mism.values())
    assert "bias" not in mism  # equal on both ranks
    # The live job, over the doctor channel, at a step all ranks reach together.
    res = areal("diverge", "--pid", str(s.proc.pid), "--json", home=home_of(s))
    assert res.returncode == 1, res.stderr + res.stdout
    data = json.loads(res.stdout)
    assert not data["ok"] and data["step"] > 0 and data["ranks"] == [0, 1]
    # The model the rank named (no loss: that belongs to a step).
    assert [(x["name"], x["ranks"]) for x in data["mismatches"]] == [
        ("weight", [1]), ("weight.grad", [1]), ("bias.grad", [1])
    ]  # fmt: skip
    text = areal("diverge", "--pid", str(s.proc.pid), home=home_of(s))
    assert "weight (param, [8, 8]) along dp [0, 1]: rank(s) [1] differ from rank 0" in (
        text.stdout
    ), text.stdout + text.stderr


def test_a_replicated_norm_weight_drifting_on_one_tp_rank(jobs):
    s = jobs["tp"]
    got = reports(s)
    mism = {(m["name"], m["dim"]): m for m in got[0]["mismatches"]}
    # Replicate on both dims: rank 3 differs from its dp peer (1) and its tp peer (2); the
    # tp-sharded weight differs across tp by design and is not reported.
    assert set(mism) == {("norm", "dp"), ("norm", "tp")}
    assert mism["norm", "dp"]["group"] == [1, 3] and mism["norm", "dp"]["ranks"] == [3]
    assert mism["norm", "tp"]["group"] == [2, 3] and mism["norm", "tp"]["ranks"] == [3]
    assert mism["norm", "tp"]["max_abs_diff"] == pytest.approx(1e-3, rel=1e-3)
    res = areal("diverge", "--pid", str(s.proc.pid), "--json", home=home_of(s))
    assert res.returncode == 1, res.stderr
    assert {(m["name"], m["dim"]) for m in json.loads(res.stdout)["mismatches"]} == set(mism)


def test_a_healthy_fsdp_job_agrees(jobs):
    s = jobs["fsdp"]
    got = reports(s)
    for rep in got:
        # Sharded parameters, gradients and Adam's moments have nothing to compare; the
        # buffer, the optimizer's steps and the reduced loss do.
        assert rep["ok"] and rep["mismatches"] == []
        assert rep["checked"] >= 6 and rep["skipped"] >= 12
    res = areal("diverge", "--pid", str(s.proc.pid), home=home_of(s))
    assert res.returncode == 0, res.stderr
    assert "all ranks agree" in res.stdout


def test_memory_per_rank_beside_the_cgroup(jobs, tmp_path):
    s = jobs["fsdp"]
    reports(s)
    res = areal("memory", "--pid", str(s.proc.pid), "--json", "--snapshot", str(tmp_path / "m"),
                home=home_of(s))  # fmt: skip
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    ranks = {r["rank"]: r for r in data["ranks"]}
    assert sorted(ranks) == [0, 1] and all(r["rss"] > 50 << 20 for r in ranks.values())
    # On the runtime's channel, on CPU: no CUDA allocator to report.
    assert all(r["cuda"] is None and r["channel"] is None for r in ranks.values())
    top = max(ranks.values(), key=lambda r: r["rss"])
    assert data["most"]["rank"] == top["rank"] and data["most"]["what"] == "rss"
    assert data["host"]["total"] > data["host"]["available"] > 0
    (cg,) = data["cgroups"].values()
    assert cg["version"] in ("v1", "v2") and cg["usage"] > 0
    for snap in data["snapshots"]:
        assert snap["kind"] == "smaps_rollup"
        breakdown = json.loads(Path(snap["path"]).read_text())
        assert breakdown["Rss"] > 50 << 20 and "Anonymous" in breakdown
    text = areal("memory", "--pid", str(s.proc.pid), home=home_of(s))
    assert f"most: rank {top['rank']} (pid {top['pid']})" in text.stdout, text.stdout


def test_profile_names_the_rank_that_computes_three_times_longer(jobs, tmp_path):
    s = jobs["slow"]
    s.wait_ready()
    out = tmp_path / "prof"
    doc = subprocess.Popen([AREAL, "doctor", "profile", "--pid", str(s.proc.pid), "--duration",
                            "3", "--out", str(out), "--json"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)  # fmt: skip
    most = 0

    def recorders_at_once() -> bool:
        # Recording runs in parallel: the three ranks' and the server's py-spy at once (one
        # after another, it would take four times the duration).
        nonlocal most
        try:
            kids = psutil.Process(doc.pid).children(recursive=True)
            now = sum(1 for k in kids if k.cmdline()[1:2] == ["record"])
        except psutil.Error:
            now = 0
        most = max(most, now)
        return most == 4 or doc.poll() is not None

    try:
        procs.wait_until(recorders_at_once, 120, cap=0.05)
        stdout, stderr = doc.communicate(timeout=120)
    finally:
        if doc.poll() is None:
            doc.kill()
            doc.wait()
    res = subprocess.CompletedProcess(doc.args, doc.returncode, stdout, stderr)
    assert res.returncode == 0, res.stderr
    assert most == 4, most
    data = json.loads(res.stdout)
    assert data["straggler"]["rank"] == 2, data
    by_rank = {r["rank"]: r for r in data["ranks"] if r["role"] == "rank"}
    assert by_rank[0]["collective_share"] > 0.4 and by_rank[2]["collective_share"] < 0.2
    assert by_rank[2]["top_self"][0]["function"].startswith("compute")
    for r in range(3):
        scope = json.loads((out / f"rank{r}.speedscope.json").read_text())
        assert scope["profiles"] and scope["shared"]["frames"]
        svg = ET.parse(out / f"rank{r}.svg").getroot()
        assert svg.tag.endswith("svg") and len(svg) > 3
    assert json.loads((out / "summary.json").read_text())["straggler"]["rank"] == 2
    # The inference server the ranks were given, recorded beside them.
    (srv,) = [r for r in data["ranks"] if r["role"] == "server"]
    assert srv["pid"] == s.server_pid and srv["samples"] > 0 and srv["error"] is None
    assert json.loads((out / "server0.speedscope.json").read_text())["profiles"]


def test_a_step_that_never_comes_is_a_timeout_and_stays_armed(jobs):
    s = jobs["stalled"]
    reports(s)
    t0 = time.monotonic()
    res = areal("diverge", "--pid", str(s.proc.pid), "--timeout", "2", home=home_of(s))
    assert res.returncode == 3, res.stdout + res.stderr
    assert "Traceback" not in res.stderr and time.monotonic() - t0 < 15
    said = " ".join(res.stderr.split())
    step = int(re.search(r"reached step (\d+) within 2s \(steps now \{0: 0, 1: 0\}\)", said)[1])
    assert "the check stays armed" in said and "areal doctor hang" in said
    # Armed on every rank still (withdrawing could split the ranks inside the check).
    for pid in s.rank_pids():
        got = channel.ask(pid, "diverge_result", step=step, wait=0, home=home_of(s))
        assert got == {"done": False, "current": 0}


def test_memory_of_ranks_without_the_runtime_is_rss_alone(jobs):
    s = jobs["slow"]
    res = areal("memory", "--pid", str(s.proc.pid), "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert len(data["ranks"]) == 3
    assert all(r["rss"] > 0 and r["channel"] == "absent" for r in data["ranks"])


def test_bad_targets_are_one_message(jobs, tmp_path):
    s = jobs["slow"]
    # Ranks that are not on the worker runtime have no channel to ask.
    res = areal("diverge", "--pid", str(s.proc.pid))
    assert res.returncode == 2 and "do not answer the doctor's channel" in res.stderr
    assert "Traceback" not in res.stderr
    res = areal("profile", "--pid", "4194000", "--out", str(tmp_path / "x"))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    (tmp_path / "file").write_text("")
    res = areal("profile", "--pid", str(s.proc.pid), "-d", "1", "--out", str(tmp_path / "file"))
    assert res.returncode == 2 and "exists and is not a folder" in res.stderr, res.stderr
    res = areal("memory", "--pid", str(s.proc.pid), "--snapshot", str(tmp_path / "file"))
    assert res.returncode == 2 and "exists and is not a folder" in res.stderr, res.stderr


def test_cgroup_limits_v1_and_v2(tmp_path):
    v2 = tmp_path / "v2"
    (v2 / "job.slice" / "step").mkdir(parents=True)
    (v2 / "job.slice" / "memory.max").write_text("1073741824\n")
    (v2 / "job.slice" / "step" / "memory.max").write_text("max\n")
    (v2 / "job.slice" / "step" / "memory.current").write_text("1000\n")
    got = memory.cgroup_limits("v2:/job.slice/step", root=v2)
    assert (got["limit"], got["limit_at"], got["usage"]) == (1 << 30, "/job.slice", 1000)
    v1 = tmp_path / "v1" / "memory" / "slurm" / "job_1"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("2147483648\n")
    (v1 / "memory.usage_in_bytes").write_text("5\n")
    (v1.parent / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # no limit
    got = memory.cgroup_limits("v1:/slurm/job_1", root=tmp_path / "v1")
    assert (got["limit"], got["limit_at"], got["usage"]) == (2 << 30, "/slurm/job_1", 5)
