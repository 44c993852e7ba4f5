"""Listing 1000 registered servers (target ≤ 50 ms), and the ratio to a bare os.walk reader
of the same ENTRY files (AReaL's own way of reading them), measured in the same run."""

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import report

from areal_cli import settings
from areal_cli.registry import FileRegistry, ServerEntry


def bare_walk(root: Path) -> list[str]:
    out = []
    for d, _, files in os.walk(root):
        if files == ["ENTRY"]:
            with open(os.path.join(d, "ENTRY")) as f:
                out.append(f.read())
    return out


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        reg = FileRegistry(tmp)
        for i in range(1000):
            reg.register(ServerEntry(id=f"h_{i}", addr=f"127.0.0.1:{20000 + i}", experiment="e",
                                     trial="t", host=settings.hostname(), pid=os.getpid()))  # fmt: skip
        ours, base = [], []
        for _ in range(7):
            t0 = time.perf_counter()
            n = len(reg.list("e", "t").servers)
            ours.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            bare_walk(Path(tmp) / settings.user() / "e" / "t" / "gen_servers")
            base.append(time.perf_counter() - t0)
        assert n == 1000
    ms = statistics.median(ours) * 1000
    ratio = statistics.median(ours) / statistics.median(base)
    print(
        f"  list(1000) {ms:.1f} ms with liveness checks; bare os.walk {statistics.median(base) * 1000:.1f} ms"
    )
    report("registry_list_1000_vs_bare_walk", ratio, "informational", True)
    return 0 if report("registry_list_1000_ms", ms, "<= 50", ms <= 50) else 1


if __name__ == "__main__":
    sys.exit(main())
