"""A trial's log files and how to read them: server-N.log, rank-N.log, torchrun*.log,
supervisor-*.log, all in one folder (on a shared filesystem under Slurm).

Every process writes its own file; nobody reads a pipe. Following a job (the foreground
terminal, `areal logs -f`) is reading those files as they grow.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

from areal_cli.errors import UsageError

TYPE_CHECKING = False  # typing's, without importing typing
if TYPE_CHECKING:
    import threading

ROLES = ("server", "rank", "torchrun", "supervisor", "watchdog")
_NAME = re.compile(r"^(server|rank)-(\d+)\.log$")


def select_logs(
    log_dir: Path, role: str | None = None, index: int | None = None
) -> dict[str, Path]:
    """label → path, ordered servers, ranks, then torchrun and supervisor."""
    if role is not None and role not in ROLES:
        raise UsageError(f"unknown role {role!r}", hint="roles: " + ", ".join(ROLES))
    found: list[tuple[int, int, str, Path]] = []
    if log_dir.is_dir():
        for p in log_dir.iterdir():
            m = _NAME.match(p.name)
            if m:
                found.append(
                    (ROLES.index(m.group(1)), int(m.group(2)), f"{m.group(1)}-{m.group(2)}", p)
                )
            elif p.name.startswith("torchrun") and p.suffix == ".log":
                found.append((ROLES.index("torchrun"), 0, p.stem, p))
            elif p.name.startswith("supervisor") and p.suffix == ".log":
                found.append((ROLES.index("supervisor"), 0, p.stem, p))
            elif p.name == "watchdog.log":  # the watchdog's verdicts (diagnose.watchdog)
                found.append((ROLES.index("watchdog"), 0, p.stem, p))
    out = {}
    for r, i, label, path in sorted(found):
        if role is not None and ROLES[r] != role:
            continue
        if index is not None and (ROLES[r] not in ("server", "rank") or i != index):
            continue
        out[label] = path
    return out


def tail(path: str | Path, n: int = 20, max_bytes: int = 64 * 1024) -> list[str]:
    """The last `n` lines of a file (reading at most its last `max_bytes`)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return []
    return data.decode(errors="replace").splitlines()[-n:] if n else []


class Follower:
    """New whole lines of a folder's log files, file by file, as they grow.

    A file replaced by a new run (see fresh_log) is told by its inode, and a filesystem
    reuses the inode of an unlinked file (ext4 hands the next run's log the very same one).
    So the follower holds every file it follows open: an open inode cannot be freed, hence
    not reused, and a file at the path with another inode than the one held is a new file,
    read from its start."""

    def __init__(
        self,
        log_dir: Path,
        role: str | None = None,
        index: int | None = None,
        history: int = 0,
        roles: tuple[str, ...] = ROLES,
    ):
        self.log_dir, self.role, self.index, self.roles = Path(log_dir), role, index, roles
        self.history = history
        self.offsets: dict[str, int] = {}
        self._held: dict[str, tuple[int, int, int]] = {}  # label → (fd, inode, device)

    def skip_existing(self) -> None:
        """Start every file that exists now at its end, unless it is replaced later."""
        for label, path in select_logs(self.log_dir, self.role, self.index).items():
            st = self._hold(label, path)
            if st is not None:
                self.offsets[label] = st.st_size

    def close(self) -> None:
        for fd, _, _ in self._held.values():
            os.close(fd)
        self._held.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter shutdown
            pass

    def poll(self) -> Iterator[tuple[str, str]]:
        for label, path in select_logs(self.log_dir, self.role, self.index).items():
            if not label.startswith(self.roles):
                continue
            if label not in self.offsets:
                yield from self._start(label, path)
                if label not in self.offsets:
                    continue  # gone before it could be opened
            yield from self._new(label, path)

    def _hold(self, label: str, path: Path) -> os.stat_result | None:
        """Open the file at `path` as the one followed under `label` (closing the one held)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        st = os.fstat(fd)
        old = self._held.pop(label, None)
        if old is not None:
            os.close(old[0])
        self._held[label] = (fd, st.st_ino, st.st_dev)
        return st

    def _start(self, label: str, path: Path) -> Iterator[tuple[str, str]]:
        st = self._hold(label, path)
        if st is None:
            return
        self.offsets[label] = 0 if self.history is None else st.st_size
        if self.history:
            for line in tail(path, self.history, max_bytes=max(64 * 1024, self.history * 512)):
                yield label, line

    def _new(self, label: str, path: Path) -> Iterator[tuple[str, str]]:
        held = self._held.get(label)
        try:
            st = path.stat()
        except OSError:
            return
        if held is None or (held[1], held[2]) != (st.st_ino, st.st_dev):
            # Another file at the path: a new run's log, read from its start.
            if self._hold(label, path) is None:
                return
            self.offsets[label] = 0
            held = self._held[label]
        start = self.offsets[label]
        try:
            size = os.fstat(held[0]).st_size
            if size < start:  # truncated where it is
                start = 0
            if size == start:
                return
            chunk = os.pread(held[0], size - start, start)
        except OSError:
            return
        # Whole lines only; a partial last line waits for the next round.
        end = chunk.rfind(b"\n") + 1
        if end == 0:
            return
        self.offsets[label] = start + end
        for line in chunk[:end].decode(errors="replace").splitlines():
            yield label, line


def job_lines(
    name: str,
    log_dir: Path,
    role: str | None,
    index: int | None,
    *,
    follow: bool,
    lines: int,
    live: Callable[[], bool],
    check_every: float = 0.0,
) -> Iterator[tuple[str, str]]:
    """`areal logs` of one job on any scheduler: the last `lines` of each of its files, then,
    following, new lines as they come until `live()` says the job ended (asked only when
    nothing new came, at most every `check_every` seconds: asking a cluster costs a
    round trip), and what was written last. A job still starting may have no files yet."""
    import time

    if not select_logs(log_dir, role, index) and not (follow and live()):
        raise UsageError(
            f"no log files for {name}" + (f" with role {role}" if role else "") + f" in {log_dir}",
            hint="roles: " + ", ".join(ROLES),
        )
    follower = Follower(log_dir, role, index, history=lines)
    checked = float("-inf")
    while True:
        got = False
        for item in follower.poll():
            got = True
            yield item
        if not follow:
            return
        if got:
            continue
        if time.monotonic() - checked >= check_every:
            checked = time.monotonic()
            if not live():
                yield from follower.poll()
                return
        time.sleep(0.2)


def follow_in_background(
    log_dir: Path,
    on_line: Callable[[str, str], None],
    stop: threading.Event,
    roles: tuple[str, ...] = ("server", "rank", "torchrun"),
    interval: float = 0.05,
) -> threading.Thread:
    """Feed the lines a new run writes to the folder's logs of `roles` to `on_line` until
    `stop` is set (then once more, so the last lines are not lost). What the files held
    before is not shown: a run writes its logs as new files (see fresh_log)."""
    import threading  # here: `areal ps` imports this module and starts no thread

    follower = Follower(log_dir, history=None, roles=roles)
    follower.skip_existing()

    def loop() -> None:
        while True:
            stopping = stop.wait(interval)
            for label, line in follower.poll():
                on_line(label, line)
            if stopping:
                follower.close()
                return

    t = threading.Thread(target=loop, name="log-follower", daemon=True)
    t.start()
    return t


def fresh_log(path: str | Path) -> int:
    """Open a run's log as a new file (a new inode, never the previous run's truncated), so
    followers tell the new run's lines from the old ones. Readable by its user only: servers
    log their arguments (SGLang its API key), trainers their prompts. Never through a symlink,
    only in a folder no other user can write (files.fresh). Returns an fd for appending."""
    from areal_cli import files

    return files.fresh(path)
