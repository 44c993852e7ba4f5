"""`areal train --max-restarts N` on the local scheduler, with real torchrun (gloo, CPU): a
SIGKILLed rank is restarted and resumes, a deterministic bug is not retried, `--restart-on any`
spends the budget, the same fault at the same place twice stops. Each decision is one line in
the terminal, the job's log and `areal ps --json`; the leak check (conftest) holds after each."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from tests.helpers import AREAL, REPO, areal, wait_for

SCRIPT = str(REPO / "tests" / "scenarios" / "restart_steps.py")


def _script(scen, fail: str) -> list[str]:
    """The scenario, its folder and its failure (restart_steps.py's arguments)."""
    return [SCRIPT, str(scen), fail]


def _train(scen: Path, fail: str, *flags: str, trial: str = "t0"):
    return areal("train", "--alloc", "fsdp:d2", "--servers", "none", "-e", "rs", "-t", trial,
                 "--watchdog", "0", *flags, *_script(scen, fail), timeout=240)  # fmt: skip


def _runs(scen: Path, rank: int) -> list[str]:
    """One line per attempt of that rank: AREAL_RESTART ('-' in the first) and its first step."""
    return (scen / f"runs-{rank}").read_text().splitlines()


def _decisions(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.startswith(("restart ", "not restarting: "))]


def _ps(name: str) -> dict:
    jobs = json.loads(areal("ps", "--all", "--json", check=0).stdout)
    return next(j for j in jobs if j["name"] == name)


def test_sigkilled_rank_restarts_and_resumes_from_its_step(tmp_path):
    scen = tmp_path / "scen"
    scen.mkdir()
    proc = subprocess.Popen(
        [AREAL, "train", "--alloc", "fsdp:d2", "--servers", "none", "-e", "rs", "-t", "kill",
         "--max-restarts", "2", *_script(scen, "wait@3")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(
            lambda: (scen / "ready-1").exists() or proc.poll() is not None, 120, "rank 1 at step 3"
        )
        assert proc.poll() is None, proc.communicate()
        os.kill(int((scen / "pid-1").read_text()), signal.SIGKILL)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    (line,) = _decisions(err)
    assert line.startswith("restart 1/2: rank 1 killed by SIGKILL (signal)"), line
    # Both ranks came back in the same job, told which restart they run in, and resumed
    # after the last step they had finished (2), not from the start.
    for rank in (0, 1):
        assert _runs(scen, rank) == ["- 1", "1 3"]
        assert (scen / f"step-{rank}").read_text() == "6"
    job = _ps("rs/kill")
    assert job["state"] == "stopped" and job["exit_code"] == 0
    assert [r["line"] for r in job["restarts"]] == [line]
    assert job["restarts"][0]["kind"] == "signal" and job["restarts"][0]["restart"]
    log_dir = Path(job["log_dir"])
    assert line in (log_dir / "supervisor-train.log").read_text()
    # The failed attempt's logs are kept aside; the folder holds the run that finished.
    assert "Connection closed by peer" in (log_dir / "attempt-1" / "rank-0.log").read_text()
    assert "step 6" in (log_dir / "rank-1.log").read_text()
    assert "SIGKILL" not in (log_dir / "torchrun.log").read_text()


def test_deterministic_bug_is_not_retried(tmp_path):
    res = _train(tmp_path, "value@3", "--max-restarts", "3", trial="bug")
    assert res.returncode == 1, res.stderr
    (line,) = _decisions(res.stderr)
    # Both ranks raise it; whichever did first is the root cause.
    assert re.match(r"not restarting: rank \d ValueError: bad batch shape at step 3 in "
                    r"restart_steps\.py:\d+ ", line), line  # fmt: skip
    assert "(python_exception) would repeat" in line
    assert _runs(tmp_path, 0) == ["- 1"]
    assert [r["line"] for r in _ps("rs/bug")["restarts"]] == [line]


def test_restart_on_any_spends_the_budget_then_stops(tmp_path):
    res = _train(tmp_path, "value@3", "--max-restarts", "2", "--restart-on", "any", trial="any")
    assert res.returncode == 1, res.stderr
    lines = _decisions(res.stderr)
    assert [x.split(":")[0] for x in lines] == ["restart 1/2", "restart 2/2", "not restarting"]
    assert "(--restart-on any)" in lines[0]
    assert re.match(r"not restarting: the 2 restarts are spent; last failure: rank \d "
                    "ValueError", lines[2]), lines[2]  # fmt: skip
    # Steps 1-2 done once: every restart resumes at 3 and fails there again.
    assert _runs(tmp_path, 0) == ["- 1", "1 3", "2 3"]


def test_same_infra_fault_at_the_same_place_twice_stops(tmp_path):
    # A CUDA error is a fault a restart may cure (a bad GPU): restarted once; the same error
    # from the same line again is a bug that repeats, whatever budget is left.
    res = _train(tmp_path, "cuda@3", "--max-restarts", "5", trial="same")
    assert res.returncode == 1, res.stderr
    lines = _decisions(res.stderr)
    assert len(lines) == 2, lines
    assert (
        lines[0].startswith("restart 1/5: rank 0 RuntimeError: CUDA error")
        and "(cuda_error)" in lines[0]
    )
    assert lines[1].startswith("not restarting: rank 0 RuntimeError: CUDA error")
    assert "again, at the same place as before restart 1" in lines[1]
    assert _runs(tmp_path, 0) == ["- 1", "1 3"]


def test_detached_job_restarts_and_logs_the_line(tmp_path):
    scen = tmp_path / "scen"
    scen.mkdir()
    areal("train", "--alloc", "fsdp:d2", "--servers", "none", "-e", "rs", "-t", "bg",
          "--max-restarts", "1", "--detach", *_script(scen, "wait@3"), check=0,
          timeout=120)  # fmt: skip
    try:
        wait_for(lambda: (scen / "ready-1").exists(), 120, "rank 1 at step 3")
        os.kill(int((scen / "pid-1").read_text()), signal.SIGKILL)
        wait_for(lambda: _ps("rs/bg")["state"] not in ("starting", "running", "stopping"),
                 180, "the job's end", interval=0.5)  # fmt: skip
    finally:
        areal("stop", "rs/bg", check=None)
    job = _ps("rs/bg")
    assert job["exit_code"] == 0, job
    (rec,) = job["restarts"]
    assert rec["line"].startswith("restart 1/1: rank 1 killed by SIGKILL (signal)")
    log = (Path(job["log_dir"]) / "supervisor-train.log").read_text()
    assert log.count(rec["line"]) == 1
    assert _runs(scen, 1) == ["- 1", "1 3"]
    table = areal("ps", "--all", check=0).stdout
    assert "restarts 1" in table and "restart 1/1: rank 1 killed by SIGKILL" in table


def test_grpo_killed_rank_resumes_from_its_checkpoint(tmp_path):
    """The GRPO example with a co-launched server: a rank SIGKILLed once a checkpoint exists
    comes back in the same job and goes on from that checkpoint, not from step 0."""
    from areal_cli.modelgen import create_tiny_model
    from areal_cli.registry import open_registry

    tiny = create_tiny_model(tmp_path / "tiny", seed=0)
    proc = subprocess.Popen(
        [AREAL, "train", "--alloc", "hf:d1+fsdp:d2", "--model", str(tiny), "-e", "rs", "-t",
         "grpo", "--max-restarts", "1", "--watchdog", "0",
         str(REPO / "templates" / "grpo" / "train.py"), "--config",
         str(REPO / "templates" / "grpo" / "tiny_cpu.yaml"), "steps=12", "save_every=2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    reg = open_registry(os.environ["AREAL_REGISTRY"])
    log_dir = Path(os.environ["AREAL_HOME"]) / "logs" / os.environ.get("USER", "root") / "rs"
    ckpts = log_dir / "grpo" / "checkpoints"
    try:
        wait_for(lambda: proc.poll() is not None or any(ckpts.glob("step-*")), 300,
                 "a first checkpoint")  # fmt: skip
        assert proc.poll() is None, proc.communicate()
        (victim,) = [r for r in reg.ranks("rs", "grpo") if r.rank == 1]
        os.kill(victim.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-4000:]
    (line,) = _decisions(err)
    assert line.startswith("restart 1/1: rank 1 killed by SIGKILL (signal)"), line
    m = re.search(r"resumed from \S+ at step (\d+)", err)
    assert m and int(m.group(1)) >= 2, err[-4000:]
    rows = [json.loads(x) for x in (log_dir / "grpo" / "metrics.jsonl").read_text().splitlines()]
    # Every step once: the resumed run goes on after its checkpoint's step, to the end.
    assert [r["step"] for r in rows] == list(range(12))


def test_ctrl_c_during_a_restart_ends_the_job_and_leaves_nothing(tmp_path):
    scen = tmp_path / "scen"
    scen.mkdir()
    proc = subprocess.Popen(
        [AREAL, "train", "--alloc", "fsdp:d2", "--servers", "none", "-e", "rs", "-t", "int",
         "--max-restarts", "3", "--restart-on", "any", *_script(scen, "value@2")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen = []
    try:
        for raw in proc.stderr:  # until the restart is said: the trainers are starting again
            seen.append(raw)
            if raw.startswith("restart 1/3"):
                proc.send_signal(signal.SIGINT)
                break
        _, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, "".join(seen) + rest
    assert not _decisions(rest), rest  # no further restart once stopped
    job = _ps("rs/int")
    assert job["state"] == "stopped" and len(job["restarts"]) == 1


def test_bad_restart_options_exit_2(tmp_path):
    res = areal("train", "--alloc", "fsdp:d1", "--servers", "none", "--restart-on", "some",
                SCRIPT, check=2)  # fmt: skip
    assert "--restart-on 'some' is not one of infra, any" in res.stderr
    assert "Traceback" not in res.stderr
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_restarts: -1\n")
    res = areal("train", "--alloc", "fsdp:d1", "--servers", "none", "--config", str(cfg),
                SCRIPT, check=2)  # fmt: skip
    assert "max_restarts" in res.stderr and "Traceback" not in res.stderr


if __name__ == "__main__":
    sys.exit("run with pytest")
