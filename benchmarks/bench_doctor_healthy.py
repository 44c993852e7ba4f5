"""`areal doctor hang` on a healthy, busy job: how often does it call a hang that is not one?

One hf server and the GRPO example (two FSDP ranks over gloo, many steps) run as the demo
runs them. While the job trains, the doctor is asked N times, alternating its default (several
samples) with a single snapshot (`--samples 1`, the baseline: what a single py-spy dump per
rank can tell). Each answer's verdict is counted:

    doctor_healthy_hang_verdicts[default]: 0/12     (target 0)
    doctor_healthy_hang_verdicts[samples=1]: 9/12   (the baseline, printed beside)
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import AREAL, report

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "templates" / "grpo" / "train.py")
CONFIG = str(REPO / "templates" / "grpo" / "tiny_cpu.yaml")
ASKS = 12


def steps_done(home: Path) -> int:
    user = os.environ.get("USER", "root")
    path = home / "logs" / user / "default" / "trial0" / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def verdict(env: dict, *extra: str) -> str:
    out = subprocess.run([AREAL, "doctor", "hang", "--job", "default/trial0", "--json", *extra],
                         env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    try:
        v = json.loads(out.stdout)["verdict"]
    except (ValueError, KeyError):
        return f"error (exit {out.returncode})"
    return f"{v['kind']}{' (hang)' if v['hang'] else ''}"


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "AREAL_HOME": f"{tmp}/home", "AREAL_REGISTRY": f"{tmp}/reg"}
        model = Path(tmp) / "m"
        subprocess.run([AREAL, "init-model", str(model)], env=env, check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        subprocess.run([AREAL, "serve", "--backend", "hf", "--model", str(model), "--detach"],
                       env=env, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        train = subprocess.Popen(
            [AREAL, "train", "--alloc", "fsdp:d2", TRAIN, "--config", CONFIG, "steps=100000"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        counts: dict[str, collections.Counter] = {"default": collections.Counter(),
                                                  "samples=1": collections.Counter()}  # fmt: skip
        try:
            deadline = time.monotonic() + 300
            while steps_done(Path(tmp) / "home") < 3:
                if train.poll() is not None or time.monotonic() > deadline:
                    print("the training job did not get going", file=sys.stderr)
                    return 1
                time.sleep(0.5)
            for _ in range(ASKS):
                counts["default"][verdict(env)] += 1
                counts["samples=1"][verdict(env, "--samples", "1")] += 1
            still_training = train.poll() is None
        finally:
            subprocess.run([AREAL, "stop", "--all"], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)  # fmt: skip
            train.wait(timeout=60)
    if not still_training:
        print("the training job ended while being asked", file=sys.stderr)
        return 1
    for name, c in counts.items():
        print(f"  {name}: " + ", ".join(f"{k} {n}" for k, n in c.most_common()))
    hangs = {k: sum(n for v, n in c.items() if "(hang)" in v or "error" in v)
             for k, c in counts.items()}  # fmt: skip
    print(f"doctor_healthy_hang_verdicts[samples=1]: {hangs['samples=1']}/{ASKS}   (baseline)")
    ok = report(
        "doctor_healthy_hang_verdicts[default]", hangs["default"], "0", hangs["default"] == 0
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
