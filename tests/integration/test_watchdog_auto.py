"""`--watchdog auto` (the default) on real torchrun gloo jobs: the limit follows the step time
the ranks report. A job of 0.3 s steps that hangs gets its verdict at the floor (20 s), well
under a minute; a step 4x the others is no stall; before enough steps are timed the fixed
value applies. The assertions are on the limit the watchdog reports, never on wall time.

The first runs through `areal train` and its supervisor (local); the others drive
watch_nodes, the cluster schedulers' entry point, with a `reach` that runs each node's command
as a plain process, and a lower floor so that the factor, not the floor, makes the limit.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from helpers import areal

from areal_cli import procs
from areal_cli.diagnose import watchdog
from tests.integration.watchdog_checks import SCRIPT, log_dir, stop, train, wait_verdict


def test_a_job_of_short_steps_that_hangs_gets_its_verdict_at_the_floor(areal_env):
    """No --watchdog: auto. Steps of 0.3 s, then rank 1 skips an all_reduce."""
    home = areal_env[0]
    plan = json.loads(areal("train", "--alloc", "fsdp:d2", "--servers", "none", "--dry-run",
                            "--json", SCRIPT, check=0).stdout)  # fmt: skip
    assert plan["watchdog_auto"] is True and plan["watchdog"] == watchdog.DEFAULT_SECONDS
    p = train("short", env={"STALL_RANK": "1", "STEPS": "12", "STEP_S": "0.3"})
    try:
        text = wait_verdict(home, 180, "short", job=p)
        bundle = Path(text.split("bundle ", 1)[1].split()[0])
        stall = json.loads((bundle / "verdict.json").read_text())
        assert stall["kind"] == "mismatched_collective" and stall["odd_ranks"] == [1], stall
        # 10x a step of about 0.3 s is under the floor: the floor applies, well under a minute.
        assert stall["limit_s"] == watchdog.FLOOR < 60, stall
        median = float(re.search(r"the median step ([0-9.]+)s", stall["limit"]).group(1))
        assert 0.3 <= median < watchdog.FLOOR / watchdog.FACTOR, stall
        assert stall["limit"].endswith(f"raised to the {watchdog.FLOOR:g}s floor"), stall
        assert stall["idle_s"] >= stall["limit_s"] and stall["latency_s"] <= stall["limit_s"] + 10
        line = f"stall: no rank progressed for {watchdog.FLOOR:g}s (auto: 10x the median step"
        assert line in text, text
        row = next(r for r in json.loads(areal("ps", "--json", check=0).stdout)
                   if r["trial"] == "short")  # fmt: skip
        assert row["watchdog"]["limit_s"] == watchdog.FLOOR
    finally:
        stop(p)


def _reach(job_id: str, commands: dict, timeout: float) -> dict:
    """Each node's command run here as a plain process (as Ray's actors run it on theirs)."""
    out = {}
    for node, argv in commands.items():
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        out[node] = (res.stdout, None if res.stdout.strip() else res.stderr[-500:])
    return out


def _stalls(home: Path, trial: str, p: subprocess.Popen, seconds: float, floor: float,
            timeout: float) -> list[watchdog.Stall]:  # fmt: skip
    """watch_nodes on the job under `auto` as soon as it has a marker (before its steps),
    until its first stall; the stalls it saw by then."""

    def marker() -> str | None:
        assert p.poll() is None, p.communicate()
        row = next((r for r in json.loads(areal("ps", "--json", check=0).stdout)
                    if r["trial"] == trial), None)  # fmt: skip
        return row["marker"] if row else None

    assert procs.wait_until(marker, 90, cap=0.2), "the job did not start"
    found = marker()
    stalls: list[watchdog.Stall] = []
    dog = watchdog.watch_nodes(
        seconds, log_dir(home, trial), job_id="job-1", nodes=lambda: ["here"], marker=found,
        reach=_reach, label=f"job default/{trial}", on_stall=stalls.append, tick=0.5,
        auto=True, floor=floor,
    )  # fmt: skip
    try:
        assert procs.wait_until(lambda: stalls, timeout, cap=0.2), "no stall"
    finally:
        dog.close()
    return stalls


def test_a_step_4x_the_others_is_no_stall_and_the_hang_after_it_is(areal_env):
    """Steps of 1 s, step 8 takes 4 s, then rank 1 hangs: one stall, the hang, at 10x the
    median step (the floor lowered to 2 s so that the factor makes the limit)."""
    home = areal_env[0]
    env = {"STALL_RANK": "1", "STEPS": "12", "STEP_S": "1.0", "SLOW_STEP": "8"}
    p = train("slow", "--watchdog", "0", env=env)
    try:
        stalls = _stalls(home, "slow", p, seconds=300, floor=2.0, timeout=240)
        rank1 = (log_dir(home, "slow") / "rank-1.log").read_text()
        assert "step 8 done" in rank1 and "skips the all_reduce of step 11" in rank1
        assert len(stalls) == 1, [s.to_json() for s in stalls]  # the slow step was none
        s = stalls[0]
        assert s.kind == "mismatched_collective" and s.odd_ranks == [1], s.to_json()
        median = float(re.search(r"10x the median step ([0-9.]+)s$", s.limit).group(1))
        assert abs(s.limit_s - 10 * median) <= 0.5  # the median is shown to 0.1 s
        # The slow step's 4 s stayed under the limit it met (the median was known by then).
        assert 4.0 < s.limit_s < watchdog.DEFAULT_SECONDS, s.to_json()
        assert s.idle_s >= s.limit_s
    finally:
        stop(p)


def test_before_enough_steps_are_timed_the_fixed_value_applies(areal_env):
    """Two steps, then the hang: too few step times for a median; the fixed value (here 4 s,
    300 s by default) is the limit, and the verdict says so."""
    home = areal_env[0]
    p = train("early", "--watchdog", "0", env={"STALL_RANK": "1", "STEPS": "3"})
    try:
        stalls = _stalls(home, "early", p, seconds=4.0, floor=1.0, timeout=120)
        s = stalls[0]
        assert s.kind == "mismatched_collective", s.to_json()
        assert s.limit_s == 4.0
        assert s.limit == f"auto: fixed until {watchdog.MIN_STEPS} steps are timed"
        line = watchdog.log_line(log_dir(home, "early"), s, 4.0)
        assert "no rank progressed for 4s (auto: fixed until 5 steps are timed)" in line
    finally:
        stop(p)


def test_the_flag_and_the_yaml_key_take_auto_seconds_or_0(areal_env, tmp_path):
    def plan(*flags: str) -> dict:
        res = areal("train", "--alloc", "fsdp:d2", "--servers", "none", "--dry-run", "--json",
                    *flags, SCRIPT, check=0)  # fmt: skip
        return json.loads(res.stdout)

    assert [plan("--watchdog", v)["watchdog_auto"] for v in ("auto", "AUTO", "60", "0")] == [
        True, True, False, False,
    ]  # fmt: skip
    assert plan("--watchdog", "60")["watchdog"] == 60 and plan("--watchdog", "0")["watchdog"] == 0
    cfg = tmp_path / "job.yaml"
    cfg.write_text("watchdog: 45\n")
    fixed = plan("--config", str(cfg))
    assert fixed["watchdog"] == 45 and fixed["watchdog_auto"] is False
    cfg.write_text("watchdog: auto\n")
    assert plan("--config", str(cfg))["watchdog_auto"] is True
    assert plan("--config", str(cfg), "--watchdog", "7")["watchdog"] == 7  # the flag wins
    for bad in ("soon", "-3", "nan", "inf"):
        res = areal("train", "--alloc", "fsdp:d2", "--servers", "none", "--dry-run",
                    f"--watchdog={bad}", SCRIPT, check=2)  # fmt: skip
        assert f"--watchdog '{bad}' is not auto, a number of seconds" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr
    cfg.write_text("watchdog: [1]\n")
    res = areal("train", "--alloc", "fsdp:d2", "--servers", "none", "--dry-run", "--config",
                str(cfg), SCRIPT, check=2)  # fmt: skip
    assert "watchdog is [1], not a str" in res.stderr and "Traceback" not in res.stderr
