"""`areal train --max-restarts N` on the local scheduler, with real torchrun (gloo, CPU): a
SIGKILLed rank is restarted and resumes, a deterministic bug is not retried, `--restart-on any`
spends the budget, the same fault at the same place twice stops. Each decision is one line in
the terminal, the job's log and `areal ps --json`; the leak check (conftest) holds after each."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from tests.helpers import AREAL, areal, wait_for
from tests.integration import restart_checks as rc

LOCAL = ("--alloc", "fsdp:d2", "--servers", "none", "--watchdog", "0")


def _train(scen: Path, fail: str, *flags: str, trial: str = "t0"):
    return areal("train", *LOCAL, "-e", "rs", "-t", trial, *flags, *rc.script(scen, fail),
                 timeout=240)  # fmt: skip


def test_sigkilled_rank_restarts_and_resumes_from_its_step(tmp_path):
    scen = tmp_path / "scen"
    scen.mkdir()
    line, job = rc.killed_step_script([*LOCAL, "-e", "rs", "-t", "kill"], scen,
                                      ready_s=120, end_s=180)  # fmt: skip
    assert job["restarts"][0]["kind"] == "signal" and job["restarts"][0]["restart"]
    log_dir = Path(job["log_dir"])
    assert line in (log_dir / "supervisor-train.log").read_text()
    # The failed attempt's logs are kept aside; the folder holds the run that finished.
    assert "Connection closed by peer" in (log_dir / "attempt-1" / "rank-0.log").read_text()
    assert "step 6" in (log_dir / "rank-1.log").read_text()
    assert "SIGKILL" not in (log_dir / "torchrun.log").read_text()


def test_deterministic_bug_is_not_retried(tmp_path):
    rc.bug_not_retried([*LOCAL, "-e", "rs", "-t", "bug"], tmp_path, timeout=240)


def test_restart_on_any_spends_the_budget_then_stops(tmp_path):
    res = _train(tmp_path, "value@3", "--max-restarts", "2", "--restart-on", "any", trial="any")
    assert res.returncode == 1, res.stderr
    lines = rc.decisions(res.stderr)
    assert [x.split(":")[0] for x in lines] == ["restart 1/2", "restart 2/2", "not restarting"]
    assert "(--restart-on any)" in lines[0]
    assert re.match(r"not restarting: the 2 restarts are spent; last failure: rank \d "
                    "ValueError", lines[2]), lines[2]  # fmt: skip
    # Steps 1-2 done once: every restart resumes at 3 and fails there again.
    assert rc.runs(tmp_path, 0) == ["- 1", "1 3", "2 3"]


def test_same_infra_fault_at_the_same_place_twice_stops(tmp_path):
    # A CUDA error is a fault a restart may cure (a bad GPU): restarted once; the same error
    # from the same line again is a bug that repeats, whatever budget is left.
    res = _train(tmp_path, "cuda@3", "--max-restarts", "5", trial="same")
    assert res.returncode == 1, res.stderr
    lines = rc.decisions(res.stderr)
    assert len(lines) == 2, lines
    assert (
        lines[0].startswith("restart 1/5: rank 0 RuntimeError: CUDA error")
        and "(cuda_error)" in lines[0]
    )
    assert lines[1].startswith("not restarting: rank 0 RuntimeError: CUDA error")
    assert "again, at the same place as before restart 1" in lines[1]
    assert rc.runs(tmp_path, 0) == ["- 1", "1 3"]


def test_detached_job_restarts_and_logs_the_line(tmp_path):
    scen = tmp_path / "scen"
    scen.mkdir()
    areal("train", "--alloc", "fsdp:d2", "--servers", "none", "-e", "rs", "-t", "bg",
          "--max-restarts", "1", "--detach", *rc.script(scen, "wait@3"), check=0,
          timeout=120)  # fmt: skip
    try:
        wait_for(lambda: (scen / "ready-1").exists(), 120, "rank 1 at step 3")
        os.kill(int((scen / "pid-1").read_text()), signal.SIGKILL)
        wait_for(lambda: rc.ps("rs/bg")["state"] not in ("starting", "running", "stopping"),
                 180, "the job's end", interval=0.5)  # fmt: skip
    finally:
        areal("stop", "rs/bg", check=None)
    job = rc.ps("rs/bg")
    assert job["exit_code"] == 0, job
    (rec,) = job["restarts"]
    assert rec["line"].startswith("restart 1/1: rank 1 killed by SIGKILL (signal)")
    log = (Path(job["log_dir"]) / "supervisor-train.log").read_text()
    assert log.count(rec["line"]) == 1
    assert rc.runs(scen, 1) == ["- 1", "1 3"]
    table = areal("ps", "--all", check=0).stdout
    assert "restarts 1" in table and "restart 1/1: rank 1 killed by SIGKILL" in table


def test_grpo_killed_rank_resumes_from_its_checkpoint(tmp_path):
    """The GRPO example with a co-launched server: a rank SIGKILLed once a checkpoint exists
    comes back in the same job and goes on from that checkpoint, not from step 0."""
    from areal_cli.modelgen import create_tiny_model

    tiny = create_tiny_model(tmp_path / "tiny", seed=0)
    rc.killed_grpo(["--alloc", "hf:d1+fsdp:d2", "--model", str(tiny)], "rs/grpo", 12,
                   ready_s=300, end_s=400)  # fmt: skip


def test_ctrl_c_during_a_restart_ends_the_job_and_leaves_nothing(tmp_path):
    scen = tmp_path / "scen"
    scen.mkdir()
    proc = subprocess.Popen(
        [AREAL, "train", "--alloc", "fsdp:d2", "--servers", "none", "-e", "rs", "-t", "int",
         "--max-restarts", "3", "--restart-on", "any", *rc.script(scen, "value@2")],
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
    assert not rc.decisions(rest), rest  # no further restart once stopped
    job = rc.ps("rs/int")
    assert job["state"] == "stopped" and len(job["restarts"]) == 1


def test_bad_restart_options_exit_2(tmp_path):
    res = areal("train", "--alloc", "fsdp:d1", "--servers", "none", "--restart-on", "some",
                rc.SCRIPT, check=2)  # fmt: skip
    assert "--restart-on 'some' is not one of infra, any" in res.stderr
    assert "Traceback" not in res.stderr
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_restarts: -1\n")
    res = areal("train", "--alloc", "fsdp:d1", "--servers", "none", "--config", str(cfg),
                rc.SCRIPT, check=2)  # fmt: skip
    assert "max_restarts" in res.stderr and "Traceback" not in res.stderr


if __name__ == "__main__":
    sys.exit("run with pytest")
