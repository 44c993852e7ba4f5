"""`--watchdog auto` (the default), measured in one run: the limit follows the step time.

auto_verdict_after_limit  a job of 0.3 s steps (tests/fixtures/scripts/watchdog_job.py, 2 gloo
                          ranks) whose rank 1 then skips an all_reduce, under auto: seconds
                          from its last progress to the verdict, less the limit that applied
                          (the 20 s floor here) (target <= 10)
auto_healthy_verdicts     the GRPO example (tiny model, hf server, 2 FSDP ranks) for 100 steps
                          under auto, its weights written to disk and reloaded by the server
                          every 10 steps (sync_method disk), its own checkpoints and a
                          consistency check every 10:
                          the verdicts in its watchdog.log (target 0)
auto_worst_step_ratio     in that run, the slowest step over the median of the 20 before it,
                          from the step times the ranks report (what auto reads); the factor
                          (10) must stay above it (target < 10)
auto_long_generation      the median step with 4x the generated tokens (64, 30 steps) over the
                          median step of the run above (target < 10)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from _common import AREAL, loadavg, report

from areal_cli.diagnose import watchdog

ROOT = Path(__file__).resolve().parents[1]
STALL_SCRIPT = str(ROOT / "tests" / "fixtures" / "scripts" / "watchdog_job.py")
TRAIN = str(ROOT / "templates" / "grpo" / "train.py")
CONFIG = str(ROOT / "templates" / "grpo" / "tiny_cpu.yaml")


def verdict_after_limit(env: dict, home: Path) -> bool:
    res = subprocess.run(
        [AREAL, "train", "--alloc", "fsdp:d2", "--servers", "none", "--trial", "hang",
         "--watchdog-action", "fail", STALL_SCRIPT],
        env={**env, "STALL_RANK": "1", "STEPS": "12", "STEP_S": "0.3"},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if res.returncode != 1:
        print(f"  exit {res.returncode}: {res.stderr[-2000:]}", file=sys.stderr)
        return False
    found = sorted(home.glob("logs/*/default/hang/watchdog-*/verdict.json"))
    stall = json.loads(found[-1].read_text())
    late = stall["latency_s"] - stall["limit_s"]
    print(f"  verdict {stall['kind']} {stall['latency_s']:.1f}s after the last progress; limit "
          f"{stall['limit_s']:g}s ({stall['limit']}); load average {loadavg()}")  # fmt: skip
    return report("auto_verdict_after_limit_s", late, "<= 10", late <= 10)


class StepTimes:
    """The step times the ranks report (what auto reads), gathered from their channels once a
    second while the job runs: by rank, {step: seconds since the step before}."""

    def __init__(self, marker: str, home: Path):
        self.marker, self.home = marker, home
        self.by_rank: dict[int, dict[int, float]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from areal_cli import procs
        from areal_cli.worker import channel

        while not self.stop.wait(1.0):
            for p in procs.find_marked(self.marker):
                try:
                    if "RANK" not in p.environ():
                        continue
                    got = channel.ask(p.pid, "progress", timeout=2.0, home=self.home)
                except Exception:
                    continue  # not a rank, or gone
                if got.get("step") is None:
                    continue
                mine = self.by_rank.setdefault(int(got["rank"]), {})
                for i, seconds in enumerate(reversed(got.get("intervals") or [])):
                    mine[int(got["step"]) - i] = seconds

    def close(self) -> dict[int, dict[int, float]]:
        self.stop.set()
        self.thread.join(timeout=10)
        return self.by_rank


def _train(env: dict, home: Path, trial: str, *args: str) -> tuple[dict[int, float], str]:
    """Train the GRPO example under auto; (rank 0's step times, watchdog.log's text)."""
    from areal_cli import procs

    p = subprocess.Popen(
        [AREAL, "train", "--alloc", "fsdp:d2", "--trial", trial, TRAIN, "--config", CONFIG,
         *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip

    def marker() -> str | None:
        res = subprocess.run([AREAL, "ps", "--json"], env=env, capture_output=True, text=True)
        rows = json.loads(res.stdout or "[]")
        # The running training job's, not the serving job's of the same trial nor an earlier
        # run's.
        return next((r["marker"] for r in rows if r["trial"] == trial and r["kind"] == "train"
                     and r["state"] == "running"), None)  # fmt: skip

    procs.wait_until(lambda: marker() or p.poll() is not None, 120, cap=0.5)
    times = StepTimes(marker() or "", home)
    _, err = p.communicate(timeout=1200)
    got = times.close()
    if p.returncode != 0 or not got.get(0):
        sys.exit(f"the GRPO example failed ({p.returncode}) or told no step times:\n{err[-2000:]}")
    log = next(home.glob(f"logs/*/default/{trial}"))
    text = (log / "watchdog.log").read_text() if (log / "watchdog.log").exists() else ""
    return got.get(0, {}), text


def serve(env: dict, model: Path, trial: str) -> None:
    subprocess.run([AREAL, "serve", "--backend", "hf", "--model", str(model), "--trial", trial,
                    "--detach"], env=env, check=True, stdout=subprocess.DEVNULL)  # fmt: skip


def healthy(env: dict, home: Path, model: Path) -> bool:
    by_step, text = _train(env, home, "trial0", "steps=100", "sync_method=disk",
                           "sync_every=10", "check_every=10")  # fmt: skip
    ok = True
    verdicts = text.count("stall:")
    order = sorted(by_step)
    steps = [by_step[k] for k in order]
    median = statistics.median(steps)
    worst, at = max(
        (steps[i] / statistics.median(steps[max(0, i - 20) : i]), order[i])
        for i in range(watchdog.MIN_STEPS, len(steps))
    )
    limit = watchdog.auto_limit(median, watchdog.DEFAULT_SECONDS)
    print(f"  {len(steps)} step times: median {median:.2f}s, p90 "
          f"{sorted(steps)[int(0.9 * len(steps))]:.2f}s, slowest {max(steps):.2f}s; auto's "
          f"limit {limit.seconds:g}s ({limit.why()}); load average {loadavg()}")  # fmt: skip
    for line in text.splitlines():
        print(f"  {line}")
    ok &= report("auto_healthy_verdicts (100 steps)", verdicts, "0", verdicts == 0)
    print(f"  the slowest step against the median of the 20 before it: step {at}")
    ok &= report("auto_worst_step_ratio", worst, f"< {watchdog.FACTOR:g}", worst < watchdog.FACTOR)
    # A trial of its own: a run in the same log folder would start from the first's state.
    serve(env, model, "long")
    long_steps, text = _train(env, home, "long", "steps=30", "max_new_tokens=64")
    long_median = statistics.median(long_steps.values())
    ratio = long_median / median
    print(f"  64 new tokens: median step {long_median:.2f}s")
    ok &= report("auto_long_generation", ratio, f"< {watchdog.FACTOR:g}", ratio < watchdog.FACTOR)
    return ok and text.count("stall:") == 0


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        env = {**os.environ, "AREAL_HOME": str(home), "AREAL_REGISTRY": f"{tmp}/reg",
               "OMP_NUM_THREADS": "1"}  # fmt: skip
        ok = verdict_after_limit(env, home)
        model = Path(tmp) / "m"
        subprocess.run([AREAL, "init-model", str(model)], env=env, check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        serve(env, model, "trial0")
        try:
            ok &= healthy(env, home, model)
        finally:
            subprocess.run([AREAL, "stop", "--all"], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
