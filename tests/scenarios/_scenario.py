"""Shared plumbing of the hang scenarios: gloo init with a long timeout, a self-destruct timer,
files that say how far each rank got, and a start signal for the busy-looping scenarios.

    SCENARIO_DIR/alive-<rank>   the rank's interpreter runs (touched on import of this module)
    SCENARIO_DIR/ready-<rank>   the main thread sits where the scenario wants it
    SCENARIO_DIR/go             written by the test: busy scenarios start burning CPU only then

SCENARIO_LIFETIME (seconds, default 120): the scenario kills itself after that even if its
test's teardown never ran.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from pathlib import Path

RANK = int(os.environ.get("RANK", "0"))
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))


def _touch(name: str) -> None:
    d = os.environ.get("SCENARIO_DIR")
    if d:
        (Path(d) / name).touch()


_touch(f"alive-{RANK}")
touch = _touch


def workdir() -> Path:
    return Path(os.environ["SCENARIO_DIR"])


def wait_for_go() -> None:
    go = Path(os.environ["SCENARIO_DIR"]) / "go"
    while not go.exists():
        time.sleep(0.05)


def self_destruct() -> None:
    timer = threading.Timer(float(os.environ.get("SCENARIO_LIFETIME", "120")), os._exit, (3,))
    timer.daemon = True
    timer.start()


def init_gloo() -> None:
    import torch.distributed as dist

    # Long enough that a hang stays a hang while the doctor looks at it.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))


def ready_when_in(function: str) -> None:
    """Touch SCENARIO_DIR/ready-<rank> as soon as the main thread's stack holds `function`."""
    main = threading.main_thread().ident
    target = Path(os.environ["SCENARIO_DIR"]) / f"ready-{RANK}"

    def watch() -> None:
        while True:
            frame = sys._current_frames().get(main)
            while frame is not None:
                if frame.f_code.co_name == function:
                    target.touch()
                    return
                frame = frame.f_back
            time.sleep(0.01)

    threading.Thread(target=watch, name="scenario-ready", daemon=True).start()
