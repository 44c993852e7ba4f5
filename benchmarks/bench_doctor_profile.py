"""`areal doctor profile --duration 5` on 8 ranks: py-spy records every rank at once, so the
whole command (start-up, recording, flame graphs, summary) takes about the duration, not 8x it.

torchrun starts 8 gloo ranks of tests/scenarios/slow_rank.py (compute, all_reduce, again; the
last rank computes three times as long). One timed run:

    doctor_profile_wall_minus_duration[8]: 1.1   (seconds; target <= 2.0)

It also checks that the straggler named is the slow rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from areal_cli import procs

sys.path.insert(0, str(Path(__file__).parent))
from _common import AREAL, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "tests" / "scenarios" / "slow_rank.py"
N, DURATION = 8, 5.0


def main() -> int:
    marker = f"bench-profile-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        env = {**os.environ, procs.MARKER_ENV: marker, "SCENARIO_DIR": str(work),
               "SCENARIO_LIFETIME": "300", "OMP_NUM_THREADS": "1"}  # fmt: skip
        port = procs.free_ports(1, start=29700)[0]
        log = open(work / "torchrun.log", "wb")
        proc = procs.spawn(
            [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={N}",
             "--master-addr=127.0.0.1", f"--master-port={port}", str(SCENARIO)],
            env=env, cwd=work, stdout=log,
        )  # fmt: skip
        log.close()
        try:
            ready = procs.wait_until(lambda: len(list(work.glob("ready-*"))) == N, 180, cap=0.5)
            if not ready:
                print((work / "torchrun.log").read_text()[-2000:])
                return 1
            time.sleep(1.0)
            t0 = time.perf_counter()
            res = subprocess.run(
                [AREAL, "doctor", "profile", "--pid", str(proc.pid), "--duration",
                 f"{DURATION:g}", "--out", str(work / "prof"), "--json"],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            wall = time.perf_counter() - t0
        finally:
            procs.kill_job(marker, [proc.pid], grace=3.0)
    if res.returncode != 0:
        print(res.stderr)
        return 1
    data = json.loads(res.stdout)
    named = (data["straggler"] or {}).get("rank")
    print(f"  {N} ranks, --duration {DURATION:g}: wall {wall:.2f}s, straggler named: rank "
          f"{named} (slow rank {N - 1})")  # fmt: skip
    ok = named == N - 1 and wall - DURATION <= 2.0
    return (
        0
        if report(f"doctor_profile_wall_minus_duration[{N}]", wall - DURATION, "<= 2.0", ok)
        else 1
    )


if __name__ == "__main__":
    sys.exit(main())
