"""Watchdog started beside every supervisor: when the supervisor dies without tearing down
(SIGKILL, OOM killer), it kills everything the job started and cleans the registry.

    python -m areal_cli.schedulers.local.reaper --parent PID --marker M --home H \
        --experiment E --trial T --registry R

It runs in a session of its own and does not carry the job marker, so it survives the
supervisor and never kills itself. A SIGTERM (normal teardown) makes it exit quietly.
While it waits it imports nothing beyond the standard library: it starts beside every job
and must not compete with the job's own start-up for CPU.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path


def _stat(pid: int) -> tuple[str, str] | None:
    """(state, start time) from /proc/PID/stat, or None when the process is gone. A stat this
    process may not read (hidepid, no CAP_SYS_PTRACE) is no sign of death: while kill(pid, 0)
    finds the pid, it counts as alive and unchanged."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        try:
            os.kill(pid, 0)
        except PermissionError:
            return ("?", "?")
        except OSError:
            return None
        return ("?", "?")
    fields = raw[raw.rfind(")") + 2 :].split()
    return fields[0], fields[19]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m areal_cli.schedulers.local.reaper")
    ap.add_argument("--parent", type=int, required=True)
    ap.add_argument("--marker", required=True)
    ap.add_argument("--home", required=True)
    ap.add_argument("--experiment", required=True)
    ap.add_argument("--trial", required=True)
    ap.add_argument("--registry", required=True)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    first = _stat(args.parent)
    while first is not None:
        now = _stat(args.parent)
        # Gone, a zombie, or a new process that reused the pid: the supervisor is dead.
        if now is None or now[0] in ("Z", "X") or now[1] != first[1]:
            break
        time.sleep(0.2)
    from areal_cli.schedulers.local import stop  # only now: see above

    stop.reap(args.marker, Path(args.home), args.experiment, args.trial, args.registry)
    return 0


if __name__ == "__main__":
    sys.exit(main())
