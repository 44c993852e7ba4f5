"""Shared timing helpers: medians of whole-command wall times, measured in one run."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent
AREAL = str(BIN / "areal")


def wall(argv: list[str], repeat: int = 5, **kw) -> float:
    """Median wall time of a whole command, in seconds."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, **kw)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def report(name: str, value: float, target: str, ok: bool) -> bool:
    mark = "ok" if ok else "MISSED"
    print(f"{name}: {value:.3f}   (target {target}, {mark})", flush=True)
    return ok
