"""Launch overhead: `areal train --alloc fsdp:d2` of a script that exits at once ÷ plain
torchrun of the same script, whole commands, same run (target ≤ 1.3)."""

import os
import socket
import sys
import tempfile
from pathlib import Path

from _common import AREAL, report, wall

SCRIPT = "import os\nassert os.environ['WORLD_SIZE'] == '2'\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "noop.py"
        script.write_text(SCRIPT)
        env = {**os.environ, "AREAL_HOME": f"{tmp}/home", "AREAL_REGISTRY": f"{tmp}/reg"}
        ours_cmd = [AREAL, "train", "--alloc", "fsdp:d2", "--servers", "none", str(script)]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "--master-port", str(free_port()), str(script)]  # fmt: skip
        ours, base = [], []
        for _ in range(3):  # interleaved, so a busy moment hits both
            base.append(wall(torchrun, repeat=1, env=env))
            ours.append(wall(ours_cmd, repeat=1, env=env))
    ours.sort()
    base.sort()
    o, b = ours[1], base[1]
    print(f"  areal train {o:.2f} s, plain torchrun {b:.2f} s (medians of 3)")
    return 0 if report("train_launch_vs_torchrun", o / b, "<= 1.3", o / b <= 1.3) else 1


if __name__ == "__main__":
    sys.exit(main())
