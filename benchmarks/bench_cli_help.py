"""`areal --help` wall time ÷ `python -m torch.distributed.run --help` (target ≤ 0.15)."""

import sys

from _common import AREAL, report, wall


def main() -> int:
    wall([AREAL, "--help"], repeat=1)  # warm the page cache for both
    wall([sys.executable, "-m", "torch.distributed.run", "--help"], repeat=1)
    ours = wall([AREAL, "--help"], repeat=7)
    base = wall([sys.executable, "-m", "torch.distributed.run", "--help"], repeat=7)
    print(f"  areal --help {ours * 1000:.0f} ms, torchrun --help {base * 1000:.0f} ms")
    return (
        0 if report("cli_help_vs_torchrun_help", ours / base, "<= 0.15", ours / base <= 0.15) else 1
    )


if __name__ == "__main__":
    sys.exit(main())
