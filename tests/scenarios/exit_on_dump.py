"""Ranks that exit once they have been dumped (EXIT_RANKS: which ones, default all): each
waits on a queue and watches its main thread's scheduler counter; py-spy's attach wakes the
blocked thread, and the rank exits a moment after it was let go, between two samples.
SCENARIO_DIR/armed-<rank> says the watch has begun."""

import os
import queue
import threading
import time
from pathlib import Path

import _scenario as sc

EXIT = {int(r) for r in os.environ.get("EXIT_RANKS", "").split(",") if r} or None


def runs_of_main() -> int:
    with open(f"/proc/self/task/{os.getpid()}/schedstat") as f:
        return int(f.read().split()[2])


def exit_when_dumped():
    ready = Path(os.environ["SCENARIO_DIR"]) / f"ready-{sc.RANK}"
    while not ready.exists():  # the main thread is asleep in next_batch from then on
        time.sleep(0.005)
    before = runs_of_main()
    (ready.parent / f"armed-{sc.RANK}").touch()
    while runs_of_main() == before:
        time.sleep(0.005)
    time.sleep(0.05)  # after the dump, before the next sample
    os._exit(0)


def next_batch():
    return queue.Queue().get()


sc.self_destruct()
if EXIT is None or sc.RANK in EXIT:
    threading.Thread(target=exit_when_dumped, daemon=True).start()
sc.ready_when_in("next_batch")
next_batch()
