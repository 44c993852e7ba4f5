"""`make bench`: run every benchmarks/bench_*.py; each prints `name: ratio` from one run."""

import subprocess
import sys
from pathlib import Path

here = Path(__file__).parent
failed = []
for bench in sorted(here.glob("bench_*.py")):
    print(f"== {bench.stem}", flush=True)
    if subprocess.run([sys.executable, str(bench)], cwd=here).returncode != 0:
        failed.append(bench.stem)
print("all benchmarks met their targets" if not failed else f"missed: {', '.join(failed)}")
sys.exit(1 if failed else 0)
