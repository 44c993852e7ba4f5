"""What the `areal train --max-restarts` tests of every scheduler share: the step-file scenario
(tests/scenarios/restart_steps.py), a run whose rank is SIGKILLed mid-way, and the checks of
what must follow (one restart decision, each rank resumed after its last step, the job ended
0), for the step script and for the GRPO example with its checkpoints."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.helpers import AREAL, REPO, areal, wait_for

SCRIPT = str(REPO / "tests" / "scenarios" / "restart_steps.py")
GRPO = (str(REPO / "templates" / "grpo" / "train.py"), "--config",
        str(REPO / "templates" / "grpo" / "tiny_cpu.yaml"))  # fmt: skip
KILLED = "restart 1/{budget}: rank 1 killed by SIGKILL (signal)"


def script(scen, fail: str) -> list[str]:
    """The scenario, its folder and its failure (restart_steps.py's arguments)."""
    return [SCRIPT, str(scen), fail]


def runs(scen: Path, rank: int) -> list[str]:
    """One line per attempt of that rank: AREAL_RESTART ('-' in the first) and its first step."""
    return (scen / f"runs-{rank}").read_text().splitlines()


def decisions(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.startswith(("restart ", "not restarting: "))]


def ps(name: str) -> dict:
    """The training job's row in `areal ps --all --json` (a serve job may share its name; a
    combined one is "serve+train")."""
    jobs = json.loads(areal("ps", "--all", "--json", check=0).stdout)
    return next(j for j in jobs if j["name"] == name and "train" in j["kind"].split("+"))


def run_and_kill(
    cmd: list[str], ready: Callable[[], object], victim: Callable[[], int], what: str,
    *, ready_s: float, end_s: float, stop_s: float = 60,
) -> tuple[int, str]:  # fmt: skip
    """Start `areal train` (cmd), SIGKILL the pid victim() gives once ready() holds, and wait
    for the job's end: (exit code, stderr). Interrupted (Ctrl-C) if the test fails first."""
    proc = subprocess.Popen(
        [AREAL, *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for(lambda: ready() or proc.poll() is not None, ready_s, what)
        assert proc.poll() is None, proc.communicate()
        os.kill(victim(), signal.SIGKILL)
        _, err = proc.communicate(timeout=end_s)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=stop_s)
    return proc.returncode, err


def killed_step_script(train: list[str], scen: Path, **times) -> tuple[str, dict]:
    """`areal train TRAIN --max-restarts 2 restart_steps.py` with rank 1 SIGKILLed at step 3:
    one restart, both ranks back in the same job and resumed after the last step they had
    finished (2), not from the start. Returns the decision line and the job's `ps` row."""
    code, err = run_and_kill(
        ["train", *train, "--max-restarts", "2", *script(scen, "wait@3")],
        lambda: (scen / "ready-1").exists(), lambda: int((scen / "pid-1").read_text()),
        "rank 1 at step 3", **times,
    )  # fmt: skip
    assert code == 0, err[-3000:]
    (line,) = decisions(err)
    assert line.startswith(KILLED.format(budget=2)), line
    for rank in (0, 1):
        assert runs(scen, rank) == ["- 1", "1 3"]
        assert (scen / f"step-{rank}").read_text() == "6"
    job = ps(_name(train))
    assert job["state"] == "stopped" and job["exit_code"] == 0
    assert [r["line"] for r in job["restarts"]] == [line]
    return line, job


def bug_not_retried(train: list[str], scen: Path, timeout: float) -> tuple[str, dict]:
    """`areal train TRAIN --max-restarts 3 restart_steps.py` raising ValueError at step 3 on
    every rank: a bug that would repeat, so no restart and exit 1 with one decision line,
    the same in `areal ps`. Returns the line and the job's `ps` row."""
    res = areal("train", *train, "--max-restarts", "3", *script(scen, "value@3"),
                timeout=timeout)  # fmt: skip
    assert res.returncode == 1, res.stderr[-3000:]
    (line,) = decisions(res.stderr)
    # Both ranks raise it; whichever did first is the root cause.
    assert re.match(r"not restarting: rank \d ValueError: bad batch shape at step 3 in "
                    r"restart_steps\.py:\d+ ", line), line  # fmt: skip
    assert "(python_exception) would repeat" in line
    assert runs(scen, 0) == ["- 1"]
    job = ps(_name(train))
    assert [r["line"] for r in job["restarts"]] == [line]
    return line, job


def _name(train: list[str]) -> str:
    """experiment/trial from the -e and -t flags of an `areal train` command line."""
    return f"{train[train.index('-e') + 1]}/{train[train.index('-t') + 1]}"


def killed_grpo(train: list[str], name: str, steps: int, **times) -> tuple[str, dict]:
    """The GRPO example (`save_every=2`) under `areal train TRAIN --max-restarts 1`, its rank
    1 (found in the registry's rank table, on whichever node it runs) SIGKILLed once a
    checkpoint exists and a step past it has pushed newer weights to the servers: one
    restart; rank 0's log says it resumed from that checkpoint (not step 0) and brought the
    servers back to its weights, which the first resumed rollout sampled (the trainer's and
    the servers' logprobs agree); the metrics have every step once; the job ends 0. Returns
    the decision line and the job's `ps` row."""
    from areal_cli.registry import open_registry
    from areal_cli.settings import log_dir
    from areal_cli.worker.checkpoint import latest

    experiment, trial = name.split("/")
    reg = open_registry(os.environ["AREAL_REGISTRY"])
    logs = log_dir(Path(os.environ["AREAL_HOME"]), experiment, trial)

    def metrics() -> list[dict]:
        path = logs / "metrics.jsonl"
        text = path.read_text() if path.exists() else ""
        return [json.loads(x) for x in text.splitlines() if x.endswith("}")]

    def past_a_checkpoint() -> bool:
        saved = latest(logs / "checkpoints")
        return saved is not None and saved.step >= 2 and len(metrics()) > saved.step

    def victim() -> int:
        (rank,) = [r for r in reg.ranks(experiment, trial) if r.rank == 1]
        return rank.pid

    code, err = run_and_kill(
        ["train", *train, "-e", experiment, "-t", trial, "--max-restarts", "1", "--watchdog",
         "0", *GRPO, f"steps={steps}", "save_every=2"],
        past_a_checkpoint, victim, "a step past a checkpoint", **times,
    )  # fmt: skip
    assert code == 0, "\n".join([*decisions(err), err[-3000:]])
    (line,) = decisions(err)
    assert line.startswith(KILLED.format(budget=1)), line
    log = (logs / "rank-0.log").read_text()
    m = re.search(r"resumed from \S+ at step (\d+)", log)
    assert m and 2 <= int(m.group(1)) < steps, log[-4000:]
    start = int(m.group(1))
    # The servers had sampled a step past the checkpoint: they are pushed its weights.
    after = log[m.end() :]
    assert "servers held other weights than the trainer's" in after, after[:2000]
    assert "pushed the trainer's weights" in after, after[:2000]
    rows = metrics()
    # Every step once: the resumed run goes on after its checkpoint's step, to the end.
    assert [r["step"] for r in rows] == list(range(steps))
    assert rows[start]["logprob_gap"] < 1e-3, rows[start]
    job = ps(name)
    assert job["state"] == "stopped" and job["exit_code"] == 0
    assert [r["line"] for r in job["restarts"]] == [line]
    return line, job


@contextmanager
def serving(scheduler: str, model: Path, name: str, timeout: float) -> Iterator[dict]:
    """`areal serve --scheduler SCHEDULER --backend hf --alloc hf:d1 --detach` of the model
    under the job name experiment/trial: its `--json` answer, the job stopped on the way out."""
    experiment, trial = name.split("/")
    res = areal("serve", "--scheduler", scheduler, "--backend", "hf", "--alloc", "hf:d1",
                "--model", str(model), "-e", experiment, "-t", trial, "--detach", "--json",
                timeout=timeout)  # fmt: skip
    assert res.returncode == 0, res.stderr
    try:
        yield json.loads(res.stdout)
    finally:
        areal("stop", name, timeout=120)
