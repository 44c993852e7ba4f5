"""CLI start-up: each command's wall time ÷ `python -c pass`, minimum of N runs, one run.

Targets: `areal --version`, `areal alloc S --json` and `areal ps --json` (no jobs) <= 3x;
`areal ps --json` in a home the local scheduler has used (it imports that scheduler and reads
its records folder) <= 4x; `areal --help` and `areal doctor hang --help` <= 5x. Runs are interleaved round-robin so
that a burst of load on the host hits every command alike; the minimum is the cost of the
command itself, without the noise.
"""

import os
import subprocess
import sys
import tempfile
import time

from _common import AREAL, report

N = 20
# name, arguments, target ratio, whether it runs in the used home.
COMMANDS = [
    ("version", ["--version"], 3.0, False),
    ("alloc_json", ["alloc", "sglang:d2t2+fsdp:d4", "--json"], 3.0, False),
    ("ps_json", ["ps", "--json"], 3.0, False),
    ("ps_json_used_home", ["ps", "--json"], 4.0, True),
    ("help", ["--help"], 5.0, False),
    ("doctor_hang_help", ["doctor", "hang", "--help"], 5.0, False),
]


def once(argv: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=env)
    return time.perf_counter() - t0


def main() -> int:
    with tempfile.TemporaryDirectory() as empty, tempfile.TemporaryDirectory() as used:
        # An empty home and registry: `ps` has no jobs to list.
        env = {**os.environ, "AREAL_HOME": empty, "AREAL_REGISTRY": empty, "COLUMNS": "80"}
        # As installed: bytecode cached (the warm-up run writes it), not compiled per call.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        # A home the local scheduler has used, its jobs ended and gone: `ps` imports that
        # scheduler and reads its records folder.
        os.makedirs(os.path.join(used, "schedulers"))
        os.makedirs(os.path.join(used, "jobs"))
        open(os.path.join(used, "schedulers", "local"), "w").close()
        used_env = {**env, "AREAL_HOME": used, "AREAL_REGISTRY": used}
        runs = {"python -c pass": ([sys.executable, "-c", "pass"], env)}
        runs.update({name: ([AREAL, *args], used_env if in_used else env)
                     for name, args, _, in_used in COMMANDS})  # fmt: skip
        best = dict.fromkeys(runs, float("inf"))
        for argv, run_env in runs.values():  # warm the page cache
            once(argv, run_env)
        for _ in range(N):
            for name, (argv, run_env) in runs.items():
                best[name] = min(best[name], once(argv, run_env))
    base = best["python -c pass"]
    print(f"  python -c pass {base * 1000:.0f} ms (minimum of {N})")
    ok = True
    for name, args, target, in_used in COMMANDS:
        ratio = best[name] / base
        where = " (used home)" if in_used else ""
        print(f"  areal {' '.join(args)}{where}: {best[name] * 1000:.0f} ms")
        ok &= report(f"cli_start_{name}", ratio, f"<= {target:g}", ratio <= target)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
