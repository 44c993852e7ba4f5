"""The watchdog and torch's flight recorder, measured in one run on 2 gloo ranks.

step_overhead      a training step (matmuls, a 1 MiB gradient all_reduce, ctx.progress)
                   under `areal train` with the recorder (2000 entries) and the watchdog on,
                   divided by the same with both off: the rank's CPU time per step (median
                   of a run; wall time on a shared host moves by more than the target),
                   5 runs each interleaved, the median of the pairs' ratios (target <= 1.01)
watchdog_tick      the watchdog's own CPU per look at every rank (it looks once a second)
detection_latency  a job whose rank 1 skips an all_reduce, `--watchdog 3`: seconds from its
                   last progress to the verdict, less the 3 s (target <= 10)
doctor_recorder    `areal doctor hang --json` on a job hung in a wrong group with the
                   recorder on, divided by the same job with it off (TORCH_FR_BUFFER_SIZE=0,
                   no entries to read); medians, interleaved (target <= 1.2)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
from _common import AREAL, report

from areal_cli import procs

ROOT = Path(__file__).resolve().parents[1]
STALL_SCRIPT = ROOT / "tests" / "fixtures" / "scripts" / "watchdog_job.py"
SCENARIOS = ROOT / "tests" / "scenarios"
MARK = f"bench-watchdog-{uuid.uuid4().hex[:8]}"

STEP_SCRIPT = """
import json, os, statistics, time
import torch, torch.distributed as dist
from areal_cli.worker import connect
ctx = connect()
w = torch.randn(512, 512)
grad = torch.ones(256 * 1024)
cpu, wall = [], []
for step in range(int(os.environ["STEPS"])):
    c0, t0 = time.process_time(), time.perf_counter()
    x = torch.randn(256, 512)
    for _ in range(8):
        x = torch.tanh(x @ w)
    dist.all_reduce(grad)
    ctx.progress(step)
    cpu.append(time.process_time() - c0)
    wall.append(time.perf_counter() - t0)
if ctx.rank == 0:
    with open(os.environ["OUT"], "w") as f:
        json.dump([statistics.median(cpu[10:]), statistics.median(wall[10:])], f)
ctx.close()
"""


def _train(trial: str, script: str, env: dict, *flags: str, timeout: float = 300):
    argv = [AREAL, "train", "--alloc", "fsdp:d2", "--servers", "none", "--trial", trial,
            *flags, script]  # fmt: skip
    return subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def step_overhead(tmp: Path) -> float:
    script = tmp / "steps.py"
    script.write_text(STEP_SCRIPT)
    on_t, off_t, ratios = [], [], []
    for i in range(5):
        got = {}
        for mode in ("off", "on"):
            out = tmp / f"step-{mode}-{i}.json"
            env = {"STEPS": "100", "OUT": str(out), "OMP_NUM_THREADS": "1"}
            if mode == "off":
                env["TORCH_FR_BUFFER_SIZE"] = "0"
                flags = ("--watchdog", "0")
            else:
                flags = ("--watchdog", "10")
            res = _train(f"bench-{mode}-{i}", str(script), env, *flags)
            if res.returncode != 0:
                raise RuntimeError(res.stderr[-2000:])
            got[mode] = json.loads(out.read_text())
        on_t.append(got["on"])
        off_t.append(got["off"])
        ratios.append(got["on"][0] / got["off"][0])
    for name, runs in (("off", off_t), ("on", on_t)):
        print(f"  {name}: step CPU ms {[round(c * 1e3, 1) for c, _ in runs]}, "
              f"wall ms {[round(w * 1e3, 1) for _, w in runs]}")  # fmt: skip
    return statistics.median(ratios)


def detection_latency(home: Path) -> float:
    res = _train("bench-stall", str(STALL_SCRIPT), {"STALL_RANK": "1", "STEPS": "3"},
                 "--watchdog", "3", "--watchdog-action", "fail")  # fmt: skip
    if res.returncode != 1:
        raise RuntimeError(f"exit {res.returncode}: {res.stderr[-2000:]}")
    found = sorted(home.glob("logs/*/default/bench-stall/watchdog-*/verdict.json"))
    stall = json.loads(found[-1].read_text())
    print(f"  verdict {stall['kind']} {stall['latency_s']:.2f}s after the last progress")
    return stall["latency_s"] - 3


def doctor_ratio(tmp: Path) -> float:
    jobs = {}
    try:
        for mode, size in (("on", "2000"), ("off", "0")):
            work = tmp / f"doctor-{mode}"
            work.mkdir()
            port = procs.free_ports(1, start=29700 + 50 * len(jobs))[0]  # both bind later
            env = {**os.environ, "SCENARIO_DIR": str(work), "SCENARIO_LIFETIME": "600",
                   "TORCH_FR_BUFFER_SIZE": size, "OMP_NUM_THREADS": "1",
                   procs.MARKER_ENV: f"{MARK}-{mode}"}  # fmt: skip
            argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                    "--master-addr=127.0.0.1", f"--master-port={port}",
                    str(SCENARIOS / "wrong_group.py")]  # fmt: skip
            jobs[mode] = procs.spawn(argv, env=env, cwd=work, stdout=subprocess.DEVNULL)
        for mode in jobs:
            assert procs.wait_until(
                lambda m=mode: len(list((tmp / f"doctor-{m}").glob("ready-*"))) == 2, 120
            ), f"{mode} not ready"
        time.sleep(1.0)
        times: dict[str, list[float]] = {"on": [], "off": []}
        kinds = {}
        for _ in range(7):
            for mode, p in jobs.items():
                t0 = time.perf_counter()
                res = subprocess.run([AREAL, "doctor", "hang", "--pid", str(p.pid), "--json"],
                                     capture_output=True, text=True, timeout=120)  # fmt: skip
                times[mode].append(time.perf_counter() - t0)
                kinds[mode] = json.loads(res.stdout)["verdict"]["kind"]
        from areal_cli.diagnose import watchdog

        pids = [c.pid for p in jobs.values() for c in psutil.Process(p.pid).children()]
        c0 = time.process_time()
        for _ in range(50):
            for pid in pids:
                watchdog.look(pid)
        tick_ms = (time.process_time() - c0) / 50 / len(pids) * 1e3
        print(f"  watchdog: {tick_ms:.2f} ms of CPU per rank and look (one look a second)")
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        print(f"  doctor hang: {on:.3f}s with the recorder ({kinds['on']}), "
              f"{off:.3f}s without ({kinds['off']})")  # fmt: skip
        return on / off
    finally:
        for mode, p in jobs.items():
            procs.kill_job(f"{MARK}-{mode}", [p.pid], grace=2.0)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="areal-bench-watchdog-") as d:
        tmp = Path(d)
        home = tmp / "home"
        os.environ["AREAL_HOME"] = str(home)
        os.environ["AREAL_REGISTRY"] = str(tmp / "registry")
        if sys.argv[1:] == ["step"]:
            return 0 if step_overhead(tmp) <= 1.01 else 1
        over = step_overhead(tmp)
        ok = report("step_overhead_recorder_and_watchdog", over, "<= 1.01", over <= 1.01)
        lat = detection_latency(home)
        ok &= report("detection_latency_beyond_seconds", lat, "<= 10 s", lat <= 10)
        ratio = doctor_ratio(tmp)
        ok &= report("doctor_hang_recorder_vs_none", ratio, "<= 1.2", ratio <= 1.2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
