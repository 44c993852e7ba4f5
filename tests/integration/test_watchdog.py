"""The watchdog on `areal train`, with real torchrun gloo jobs: a stalled job gets one verdict
and a bundle (log, ps, logs); --watchdog-action fail ends it with exit 1; a healthy job whose
steps take 0.8 x the watchdog's seconds gets none.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from helpers import FAKE_PYTHON, areal

from areal_cli import procs
from tests.integration.watchdog_checks import SCRIPT, log_dir, stop, train, wait_verdict


def test_a_stalled_job_gets_one_verdict_and_a_bundle(areal_env):
    home = areal_env[0]
    p = train("stall", "--watchdog", "3", env={"STALL_RANK": "1", "STEPS": "3"})
    try:
        text = wait_verdict(home, 90, "stall", job=p)
        logs = log_dir(home, "stall")
        assert (
            "stall: no rank progressed for 3s; verdict mismatched_collective (odd ranks 1)" in text
        )
        assert "rank 0: collective #3 of group default_pg (all_reduce, scheduled)" in text
        bundle = Path(text.split("bundle ", 1)[1].split()[0])
        assert bundle.parent == logs
        stall = json.loads((bundle / "verdict.json").read_text())
        assert stall["kind"] == "mismatched_collective" and stall["odd_ranks"] == [1]
        assert stall["latency_s"] <= 3 + 10, stall
        summary = json.loads((bundle / "summary.json").read_text())
        assert {r["rank"] for r in summary["ranks"]} == {0, 1}
        assert sorted(x.name for x in (bundle / "flight-recorder").iterdir()) == [
            "rank0.json", "rank1.json", "torch",
        ]  # fmt: skip
        assert len(list(bundle.glob("rank*-pid*.json"))) >= 2  # every rank's stack
        tail = (bundle / "logs" / "rank-1.tail.log").read_text()
        assert "rank 1 skips the all_reduce of step 2" in tail

        ps = json.loads(areal("ps", "--json", check=0).stdout)
        job = next(j for j in ps if j["trial"] == "stall")
        assert job["state"] == "running" and job["watchdog"]["kind"] == "mismatched_collective"
        assert "stalled: mismatched_collective ranks 1" in areal("ps", check=0).stdout
        shown = areal("logs", "default/stall", check=0).stdout
        assert "[watchdog]" in shown and "verdict mismatched_collective" in shown

        time.sleep(4.5)  # another period of the watchdog and more: still one verdict
        assert (logs / "watchdog.log").read_text().count("stall:") == 1
        assert len(list(logs.glob("watchdog-*"))) == 1
    finally:
        stop(p)


def test_fail_action_ends_a_plain_script_with_exit_1_naming_the_verdict(areal_env, tmp_path):
    """No rank reports (plain torch.distributed): the watchdog goes by their movement. The
    job's own server (a stand-in) gets its stack kept too."""
    model = tmp_path / "model"
    model.mkdir()
    with_server = ("--alloc", "hf:d1+fsdp:d2", "--model", str(model), "--python", FAKE_PYTHON)
    p = train("fail", "--watchdog", "3", "--watchdog-action", "fail", alloc=with_server,
               env={"STALL_RANK": "1", "STEPS": "3", "PLAIN": "1"})  # fmt: skip
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1, (out, err)
    first = next(line for line in err.splitlines() if "error" in line.lower())
    assert "watchdog: mismatched_collective (odd ranks 1)" in first, err
    rec = json.loads(areal("ps", "--all", "--json", check=0).stdout)
    job = next(j for j in rec if j["trial"] == "fail")
    assert job["state"] == "failed" and job["watchdog"]["odd_ranks"] == [1]
    servers = Path(job["watchdog"]["bundle"]) / "servers"
    assert [x.suffix for x in servers.iterdir()] == [".json"], list(servers.iterdir())


def test_a_healthy_job_with_slow_steps_gets_no_verdict(areal_env):
    home = areal_env[0]
    # Steps of 0.8 x the watchdog's seconds, reported with ctx.progress.
    p = train("slow", "--watchdog", "3", env={"STEPS": "3", "STEP_S": "2.4"})
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, (out, err)
    logs = log_dir(home, "slow")
    assert not (logs / "watchdog.log").exists()
    assert not list(logs.glob("watchdog-*"))


def test_dry_run_shows_the_recorder_and_the_watchdog(areal_env):
    plan = json.loads(areal("train", "--alloc", "fsdp:d2", "--servers", "none", "--dry-run",
                            "--json", SCRIPT, check=0).stdout)  # fmt: skip
    env = plan["processes"][0]["env"]
    assert env["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env  # torch 2.13 warns it is deprecated
    assert plan["watchdog"] == 300 and plan["watchdog_action"] == "observe"
    off = json.loads(areal("train", "--alloc", "fsdp:d2", "--servers", "none", "--dry-run",
                           "--json", "--watchdog", "0", SCRIPT, check=0,
                           env={"TORCH_FR_BUFFER_SIZE": "0"}).stdout)  # fmt: skip
    assert off["watchdog"] == 0
    assert "TORCH_FR_BUFFER_SIZE" not in off["processes"][0]["env"]  # the user's own (0) holds
    res = areal("train", "--alloc", "fsdp:d2", "--servers", "none", "--dry-run",
                "--watchdog-action", "page", SCRIPT, check=2)  # fmt: skip
    assert "--watchdog-action 'page' is not one of observe, fail" in res.stderr
    assert "Traceback" not in res.stderr


def test_watch_nodes_drives_any_scheduler_through_its_way_to_reach_nodes(areal_env, tmp_path):
    """The entry point a cluster scheduler calls, with a `reach` that is no srun: each node's
    command run here as a plain process (as Ray's actors run it on their nodes). The job's
    ranks are found by its marker, looked at, and on the stall the hang doctor runs through
    the same reach, flight recorders included."""
    from areal_cli.diagnose import watchdog

    home = areal_env[0]
    p = train("reach", "--watchdog", "0", env={"STALL_RANK": "1", "STEPS": "3"})
    calls: list[list[str]] = []

    def reach(job_id: str, commands: dict, timeout: float) -> dict:
        assert job_id == "job-7"
        out = {}
        for node, argv in commands.items():
            calls.append(argv)
            res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
            out[node] = (res.stdout, None if res.stdout.strip() else res.stderr[-500:])
        return out

    try:

        def marker() -> str | None:
            assert p.poll() is None, p.communicate()
            rows = json.loads(areal("ps", "--json", check=0).stdout)
            row = next((r for r in rows if r["trial"] == "reach"), None)
            ready = row and (log_dir(home, "reach") / "rank-1.log").exists()
            return row["marker"] if ready and "skips" in (
                log_dir(home, "reach") / "rank-1.log").read_text() else None  # fmt: skip

        found = procs.wait_until(marker, 90, cap=0.2)
        assert found, "the job did not get to its stall"
        stalls = []
        dog = watchdog.watch_nodes(
            2.0, log_dir(home, "reach"), job_id="job-7", nodes=lambda: ["here"],
            marker=marker(), reach=reach, label="job default/reach", on_stall=stalls.append,
            tick=0.5,
        )  # fmt: skip
        try:
            assert procs.wait_until(lambda: stalls, 60, cap=0.2), "no stall"
        finally:
            dog.close()
        s = stalls[0]
        assert s.kind == "mismatched_collective" and s.odd_ranks == [1], s
        assert sorted(s.reached) == ["0", "1"]  # the flight recorders, through the reach
        assert any("areal_cli.diagnose.nodes" in a for argv in calls for a in argv)
        assert (Path(s.bundle) / "summary.json").exists()
        assert len(stalls) == 1
    finally:
        stop(p)
