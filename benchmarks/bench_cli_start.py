"""CLI start-up: each command's wall time ÷ `python -c pass`, minimum of N runs, one run.

Targets: `areal --version`, `areal alloc S --json` and `areal ps --json` (no jobs) <= 3x;
`areal --help` and `areal doctor hang --help` <= 5x. Runs are interleaved round-robin so
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
COMMANDS = [
    ("version", ["--version"], 3.0),
    ("alloc_json", ["alloc", "sglang:d2t2+fsdp:d4", "--json"], 3.0),
    ("ps_json", ["ps", "--json"], 3.0),
    ("help", ["--help"], 5.0),
    ("doctor_hang_help", ["doctor", "hang", "--help"], 5.0),
]


def once(argv: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=env)
    return time.perf_counter() - t0


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        # An empty home and registry: `ps` has no jobs to list.
        env = {**os.environ, "AREAL_HOME": tmp, "AREAL_REGISTRY": tmp, "COLUMNS": "80"}
        # As installed: bytecode cached (the warm-up run writes it), not compiled per call.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        runs = {"python -c pass": [sys.executable, "-c", "pass"]}
        runs.update({name: [AREAL, *args] for name, args, _ in COMMANDS})
        best = dict.fromkeys(runs, float("inf"))
        for argv in runs.values():  # warm the page cache
            once(argv, env)
        for _ in range(N):
            for name, argv in runs.items():
                best[name] = min(best[name], once(argv, env))
    base = best["python -c pass"]
    print(f"  python -c pass {base * 1000:.0f} ms (minimum of {N})")
    ok = True
    for name, args, target in COMMANDS:
        ratio = best[name] / base
        print(f"  areal {' '.join(args)}: {best[name] * 1000:.0f} ms")
        ok &= report(f"cli_start_{name}", ratio, f"<= {target:g}", ratio <= target)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
