"""Readiness overhead: `areal serve --backend hf` d2 time-to-ready minus the servers' own time
to a first healthy answer (both started directly, polled every 5 ms). Target ≤ 0.5 s.

With the SGLang CPU build (`make engines`; AREAL_ENGINES, default /var/cache/areal-engines):
`areal serve --backend sglang` d1 minus the engine's own time, the launch command that
`areal serve --dry-run --json` plans run raw until its /health answers, before and after
`areal serve` (the faster counts; the first is also a warm-up): the engine takes half a
minute or more to start here. The raw runs also say when its /ready turned 200 (its own
warm-up generation answered, what areal's readiness waits for): /health answers a second
and more after that. areal's check that the interpreter's engine runs on CPU (it imports
torch) is remembered per interpreter after a first serve: the benchmark makes that first
check beforehand and prints what it cost. Without the build it prints a skip line.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import AREAL, free_port, healthy, report
from _engines import sglang_python

from areal_cli.modelgen import create_tiny_model


def direct(model: Path) -> float:
    ports = [free_port(), free_port()]
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "areal_cli.server",
                "--model-path",
                str(model),
                "--port",
                str(p),
                "--device",
                "cpu",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for p in ports
    ]
    try:
        pending = set(ports)
        while pending:
            pending = {p for p in pending if not healthy(p)}
            time.sleep(0.005)
        return time.perf_counter() - t0
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()


def via_areal(model: Path, env: dict) -> float:
    t0 = time.perf_counter()
    res = subprocess.run([AREAL, "serve", "--backend", "hf", "--model", str(model), "--alloc",
                          "hf:d2", "--trial", "bench", "--detach"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    if res.returncode:
        sys.exit(f"areal serve failed:\n{res.stderr}")
    took = time.perf_counter() - t0
    subprocess.run([AREAL, "stop", "default/bench"], env=env, check=True, stdout=subprocess.DEVNULL)
    return took


def ready(port: int) -> bool:
    return healthy(port, "/ready", timeout=1)


class Watch(threading.Thread):
    """Beside one `areal serve`: when each of its processes started (supervisor, runner,
    engine) and, asked of the engine at its port every 5 ms as the raw runs ask, when its
    /ready and then its /health first answered 200: the split of that one start."""

    ROLES = {"supervisor": "schedulers.local.supervisor", "runner": "launchers.replica",
             "engine": "sglang.launch_server"}  # fmt: skip

    def __init__(self, model: str, home: str):
        super().__init__(daemon=True)
        self.model, self.home = model, home
        self.stop = threading.Event()
        self.at: dict[str, float] = {}  # perf_counter of each event

    def run(self) -> None:
        import psutil

        # A process's start time is the kernel's boot time (whole seconds) plus its start in
        # clock ticks: calibrated on a process started here, at a known moment.
        t = time.perf_counter()
        probe = subprocess.Popen(["sleep", "0"])
        offset = t - psutil.Process(probe.pid).create_time()
        probe.wait()
        port = None
        while not self.stop.is_set() and "health" not in self.at:
            if port is None:
                for p in psutil.process_iter(["cmdline", "create_time"]):
                    line = p.info["cmdline"] or []
                    text = " ".join(line)
                    for role, key in self.ROLES.items():
                        # Only this run's: other jobs on the host have supervisors too.
                        mine = self.model if role == "engine" else self.home
                        if role not in self.at and key in text and mine in text:
                            self.at[role] = p.info["create_time"] + offset
                            if role == "engine" and "--port" in line:
                                port = int(line[line.index("--port") + 1])
            elif "ready" not in self.at:
                if ready(port):
                    self.at["ready"] = time.perf_counter()
            elif healthy(port):
                self.at["health"] = time.perf_counter()
            # A process's start time is exact whenever it is seen: the table is read
            # every 50 ms (a read costs the host), the engine's port every 5 ms.
            time.sleep(0.05 if port is None else 0.005)

    def split(self, t0: float, total: float) -> None:
        at = {k: v - t0 for k, v in self.at.items()}
        if not {"supervisor", "runner", "engine", "ready", "health"} <= set(at):
            print(f"  (split incomplete: {sorted(at)})")
            return
        engine = at["health"] - at["engine"]
        print(
            f"  one start: supervisor spawned at {at['supervisor']:.2f} s (CLI start-up, plan), "
            f"runner +{at['runner'] - at['supervisor']:.2f} s, engine +"
            f"{at['engine'] - at['runner']:.2f} s; engine (its key launcher, same pid) to /ready "
            f"{at['ready'] - at['engine']:.2f} s, to /health {engine:.2f} s; /ready to ready "
            f"+{total - at['ready']:.2f} s (poll, registration, supervisor, exit); "
            f"total {total:.2f} s"
        )
        print(f"serve_ready_overhead_s[sglang,same start]: {total - engine:.3f}   "
              "(informational: the engine's own time from the same start)")  # fmt: skip


def remember_cpu_check(python: str, env: dict) -> float:
    """The first serve's check that `python`'s SGLang runs on CPU, made now (seconds)."""
    from areal_cli import backends

    before = os.environ.get("AREAL_HOME")
    os.environ["AREAL_HOME"] = env["AREAL_HOME"]
    try:
        t0 = time.perf_counter()
        backends.check_installed(backends.get("sglang"), python, on_gpu=False)
        return time.perf_counter() - t0
    finally:
        if before is None:
            os.environ.pop("AREAL_HOME")
        else:
            os.environ["AREAL_HOME"] = before


def sglang_case(model: Path, env: dict, python: str) -> tuple[float, float]:
    """(the engine's own time to healthy, the faster of a try before and one after;
    areal serve's time to ready, between them)."""
    serve = [AREAL, "serve", "--backend", "sglang", "--model", str(model), "--python", python,
             "--trial", "bench-sglang"]  # fmt: skip
    plan = json.loads(subprocess.run([*serve, "--dry-run", "--json"], env=env, check=True,
                                     capture_output=True, text=True).stdout)  # fmt: skip
    proc = plan["processes"][0]
    argv = proc["argv"][proc["argv"].index("--") + 1 :]  # the engine, without the launch wrapper
    raw_env = {**os.environ, **{k: v for k, v in proc["env"].items() if "API_KEY" not in k}}

    def raw() -> float:
        port = free_port()
        argv[argv.index("--port") + 1] = str(port)
        t0 = time.perf_counter()
        engine = subprocess.Popen(argv, env=raw_env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        try:
            # /ready first: a /health asked while it turns Up would answer 503 and be asked
            # again anyway; /health asked at once after takes what it takes.
            for probe in (ready, healthy):
                while not probe(port):
                    if engine.poll() is not None:
                        sys.exit(f"SGLang exited {engine.returncode} before it was ready")
                    time.sleep(0.005)
                took[probe.__name__].append(time.perf_counter() - t0)
            return took["healthy"][-1]
        finally:
            os.killpg(engine.pid, 15)
            engine.wait()

    took: dict[str, list[float]] = {"ready": [], "healthy": []}
    cold = remember_cpu_check(python, env)
    print(f"  the first serve's CPU-build check of {python}: {cold:.2f} s (remembered after)")
    before = raw()  # also the warm-up: page cache and bytecode of the engine's venv
    watch = Watch(str(model), env["AREAL_HOME"])
    watch.start()
    t0 = time.perf_counter()
    res = subprocess.run([*serve, "--detach"], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
    took_serve = time.perf_counter() - t0
    watch.stop.set()
    watch.join()
    watch.split(t0, took_serve)
    subprocess.run([AREAL, "stop", "default/bench-sglang"], env=env, stdout=subprocess.DEVNULL)
    if res.returncode:
        sys.exit(f"areal serve --backend sglang failed:\n{res.stderr[-2000:]}")
    after = raw()
    print(f"  SGLang alone: {before:.2f} s before areal serve, {after:.2f} s after, to /health; "
          f"to /ready {took['ready'][0]:.2f} s and {took['ready'][1]:.2f} s "
          f"(load {os.getloadavg()[0]:.1f})")  # fmt: skip
    own = min(before, after)
    return own, took_serve


def main() -> int:
    only_sglang = "--only-sglang" in sys.argv[1:]
    ok = True
    python = sglang_python()
    if python is None:
        print("serve_ready_overhead_s[sglang]: skipped (no SGLang build; `make engines`)")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            model = create_tiny_model(Path(tmp) / "tiny")
            env = {**os.environ, "AREAL_HOME": f"{tmp}/home", "AREAL_REGISTRY": f"{tmp}/reg"}
            own, took = sglang_case(model, env, python)
        print(f"  SGLang alone {own:.2f} s to healthy; areal serve --detach {took:.2f} s to ready")
        ok &= report("serve_ready_overhead_s[sglang]", took - own, "<= 0.5", took - own <= 0.5)
    if only_sglang:
        return 0 if ok else 1
    with tempfile.TemporaryDirectory() as tmp:
        model = create_tiny_model(Path(tmp) / "tiny")
        env = {**os.environ, "AREAL_HOME": f"{tmp}/home", "AREAL_REGISTRY": f"{tmp}/reg"}
        base, ours = [], []
        for _ in range(3):
            base.append(direct(model))
            ours.append(via_areal(model, env))
    b, o = statistics.median(base), statistics.median(ours)
    print(f"  servers alone {b:.2f} s to healthy; areal serve --detach {o:.2f} s to ready")
    report("serve_ready_vs_direct_ratio", o / b, "informational", True)
    ok &= report("serve_ready_overhead_s", o - b, "<= 0.5", o - b <= 0.5)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
