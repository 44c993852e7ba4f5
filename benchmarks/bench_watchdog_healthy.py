"""The watchdog on a healthy, busy job: how many verdicts does it give where there is no hang?

One hf server and the GRPO example (two FSDP ranks over gloo) run as the demo runs them. A
first run measures the step time (the median of metrics.jsonl's step_time_s); the second runs
40 steps under `--watchdog 3 x that step time`, so the watchdog sees at least 10 windows of
SECONDS each, and every verdict in its watchdog.log is counted:

    watchdog_healthy_verdicts: 0/13 windows   (target 0)

The slowest step of the watched run is printed beside, as a share of SECONDS: the issue asks
for no verdict on steps up to 0.8 x SECONDS.

Where a Slurm cluster answers (sbatch on PATH, SLURM_CONF), the watchdog inside a batch job is
measured too: a two-node job whose ranks all_reduce in a loop (tests/integration/slurm_hang.py,
SLURM_HANG_LOOP=1, no progress reports: movement evidence, one srun per node per look) under
`--watchdog 2` for 30 s:

    watchdog_healthy_verdicts[slurm]: 0/15 windows   (target 0)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import AREAL, report

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "templates" / "grpo" / "train.py")
CONFIG = str(REPO / "templates" / "grpo" / "tiny_cpu.yaml")
STEPS = 40
MIN_WINDOWS = 10


def _rows(home: Path, trial: str) -> list[dict]:
    user = os.environ.get("USER", "root")
    path = home / "logs" / user / "default" / trial / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _train(env: dict, trial: str, steps: int, *flags: str) -> float:
    # Both runs share the trial the servers are registered under: resume=false, or the second
    # run would resume from the first one's checkpoint and train nothing.
    t0 = time.monotonic()
    subprocess.run(
        [AREAL, "train", "--alloc", "fsdp:d2", "--trial", trial, *flags, TRAIN, "--config",
         CONFIG, f"steps={steps}", "resume=false"],
        env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900,
    )  # fmt: skip
    return time.monotonic() - t0


def slurm(seconds: float = 2.0, watch_s: float = 30.0) -> bool | None:
    """The healthy loop on Slurm; None when there is no cluster to run on."""
    import shutil

    if not shutil.which("sbatch") or not os.environ.get("SLURM_CONF"):
        print("  (no Slurm cluster: its line is left out)")
        return None
    script = str(REPO / "tests" / "integration" / "slurm_hang.py")
    with tempfile.TemporaryDirectory(dir=os.environ.get("AREAL_BENCH_SHARED")) as tmp:
        home = Path(tmp) / "home"
        env = {**os.environ, "AREAL_HOME": str(home), "AREAL_REGISTRY": f"{tmp}/reg",
               "SLURM_HANG_LOOP": "1", "SLURM_HANG_LIFETIME": "120"}  # fmt: skip
        train = subprocess.Popen(
            [AREAL, "train", "--scheduler", "slurm", "--alloc", "fsdp:d2", "--gpus-per-node",
             "1", "--servers", "none", "--watchdog", f"{seconds:g}", script],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        log = home / "logs" / os.environ.get("USER", "root") / "default" / "trial0"
        try:
            deadline = time.monotonic() + 120
            while (
                not (log / "rank-1.log").exists() or "on n" not in (log / "rank-1.log").read_text()
            ):
                if train.poll() is not None or time.monotonic() > deadline:
                    print("  the Slurm job did not get going", file=sys.stderr)
                    return False
                time.sleep(0.5)
            time.sleep(watch_s)
            alive = train.poll() is None
            text = (log / "watchdog.log").read_text() if (log / "watchdog.log").exists() else ""
        finally:
            subprocess.run([AREAL, "stop", "default/trial0"], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)  # fmt: skip
            train.wait(timeout=60)
    for line in text.splitlines():
        print(f"  {line}")
    windows, verdicts = int(watch_s // seconds), text.count("stall:")
    return report(f"watchdog_healthy_verdicts[slurm] ({verdicts}/{windows} windows)", verdicts,
                  "0", verdicts == 0 and alive)  # fmt: skip


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        env = {**os.environ, "AREAL_HOME": str(home), "AREAL_REGISTRY": f"{tmp}/reg"}
        model = Path(tmp) / "m"
        subprocess.run([AREAL, "init-model", str(model)], env=env, check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        subprocess.run([AREAL, "serve", "--backend", "hf", "--model", str(model), "--detach"],
                       env=env, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        try:
            # One trial for both runs: the one the servers are registered under.
            _train(env, "trial0", 8, "--watchdog", "0")
            calibration = _rows(home, "trial0")
            step_s = statistics.median(r["step_time_s"] for r in calibration[2:])
            seconds = round(3 * step_s, 2)
            took = _train(env, "trial0", STEPS, "--watchdog", f"{seconds:g}")
            rows = _rows(home, "trial0")
            rows = rows[len(calibration) :] if len(rows) > STEPS else rows  # appended or anew
            log = home / "logs" / os.environ.get("USER", "root") / "default" / "trial0"
            text = (log / "watchdog.log").read_text() if (log / "watchdog.log").exists() else ""
        finally:
            subprocess.run([AREAL, "stop", "--all"], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)  # fmt: skip
    trained = sum(r["step_time_s"] for r in rows)
    windows = int(trained // seconds)
    verdicts = text.count("stall:")
    slowest = max(r["step_time_s"] for r in rows)
    print(f"  step {step_s:.2f}s (median of the calibration run), --watchdog {seconds:g}; "
          f"{len(rows)} steps in {trained:.1f}s of training ({took:.1f}s with start-up); "
          f"slowest step {slowest:.2f}s = {slowest / seconds:.2f} x SECONDS")  # fmt: skip
    for line in text.splitlines():
        print(f"  {line}")
    if windows < MIN_WINDOWS:
        print(f"only {windows} windows of {seconds:g}s watched", file=sys.stderr)
        return 1
    ok = report(f"watchdog_healthy_verdicts ({verdicts}/{windows} windows)", verdicts, "0",
                verdicts == 0)  # fmt: skip
    on_slurm = slurm()
    return 0 if ok and on_slurm is not False else 1


if __name__ == "__main__":
    sys.exit(main())
