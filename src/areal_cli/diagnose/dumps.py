"""What a py-spy dump holds: `Frame`, `ThreadStack`, `Dump`, and py-spy's `dump --json` text
parsed into them.

Apart from diagnose.stacks, which runs py-spy: stacks is imported before the first py-spy
starts and these (dataclasses, json) are not needed until one has finished, so a doctor
imports them while the dumps run. `stacks.Dump` and the others still name these.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from areal_cli.diagnose.stacks import Counters


@dataclass(frozen=True)
class Frame:
    function: str  # qualified name as py-spy gives it, e.g. "Queue.get"
    file: str  # full path, or a pseudo name such as "<frozen runpy>"
    line: int
    short: str = ""  # py-spy's short file name (package-relative)
    locals: tuple[tuple[str, str], ...] | None = None
    native: bool = False
    # The source line, when the file is readable on this host (filled in by `with_source`).
    code: str | None = None

    @property
    def basename(self) -> str:
        """The function name without its class: `Queue.get` -> `get`."""
        return self.function.rsplit(".", 1)[-1]

    def where(self) -> str:
        return f"{self.short or self.file}:{self.line}"

    def to_json(self) -> dict:
        d = {
            "function": self.function,
            "file": self.file,
            "short": self.short or self.file,
            "line": self.line,
        }
        if self.native:
            d["native"] = True
        if self.code is not None:
            d["code"] = self.code
        if self.locals is not None:
            d["locals"] = dict(self.locals)
        return d


@dataclass(frozen=True)
class ThreadStack:
    thread_id: int
    os_thread_id: int | None
    name: str | None
    active: bool  # py-spy's view: on CPU (not sleeping in a syscall)
    owns_gil: bool
    frames: tuple[Frame, ...]  # innermost first, as py-spy prints them


@dataclass
class Dump:
    """One py-spy snapshot of one process (or why there is none)."""

    pid: int
    threads: list[ThreadStack] = field(default_factory=list)
    raw: str = ""  # py-spy's JSON text, kept for bug reports
    error: str | None = None
    # "gone" (the process exited), "permission", "version", "timeout", "not_python", "failed"
    error_kind: str | None = None
    taken_at: float = 0.0
    elapsed_s: float = 0.0
    # Scheduler counters of each Python thread once py-spy had let go of it.
    counters: Counters = field(default_factory=dict)
    # Times each thread was scheduled in since the previous sample, not counting the dumps;
    # None on the first sample or where unknown.
    ran: dict[int, int] | None = None
    # Threads whose resume after the dump was counted ahead in `counters` (see
    # counters_after_dump).
    pending: frozenset[int] = frozenset()
    # No Python thread ran since the previous sample, so that sample's stacks were kept.
    reused: bool = False
    # The process is stopped (state T: SIGSTOP, Ctrl-Z): it cannot take part in anything.
    stopped: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None

    def main_thread(self) -> ThreadStack | None:
        for t in self.threads:
            if t.os_thread_id == self.pid:
                return t
        for t in self.threads:
            if t.name == "MainThread":
                return t
        return self.threads[0] if self.threads else None


# --------------------------------------------------------------------------- parsing


def parse_pyspy_json(text: str) -> list[ThreadStack]:
    """py-spy's `dump --json` output -> threads with frames (innermost first)."""
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError("expected a list of threads")
    threads = []
    for t in data:
        frames = []
        for f in t.get("frames") or []:
            filename = f.get("filename") or "?"
            loc = f.get("locals")
            locals_ = None
            if isinstance(loc, list):
                locals_ = tuple(
                    (str(v.get("name")), str(v.get("repr") if v.get("repr") is not None else "?"))
                    for v in loc
                    if isinstance(v, dict)
                )
            frames.append(
                Frame(
                    function=f.get("name") or "?",
                    file=filename,
                    line=int(f.get("line") or 0),
                    short=f.get("short_filename") or filename,
                    locals=locals_,
                    native=_is_native_file(filename),
                )
            )
        threads.append(
            ThreadStack(
                thread_id=int(t.get("thread_id") or 0),
                os_thread_id=t.get("os_thread_id"),
                name=t.get("thread_name"),
                active=bool(t.get("active")),
                owns_gil=bool(t.get("owns_gil")),
                frames=tuple(frames),
            )
        )
    return threads


def _is_native_file(filename: str) -> bool:
    # With --native, py-spy adds C/C++ frames whose "file" is a .so, a C/C++ source or "?".
    return (
        filename.endswith((".so", ".c", ".cc", ".cpp", ".cu", ".h", ".hpp")) or ".so." in filename
    )


def with_source(threads: list[ThreadStack]) -> list[ThreadStack]:
    """Attach the source line to every Python frame whose file is readable here.

    The line tells what a frame blocked in native code waits on (`work.wait()`), which py-spy
    alone cannot show without --native.
    """
    import linecache

    out = []
    for t in threads:
        frames = []
        for f in t.frames:
            code = None
            if not f.native and f.file and not f.file.startswith("<"):
                code = linecache.getline(f.file, f.line).strip() or None
            frames.append(
                Frame(f.function, f.file, f.line, f.short, f.locals, f.native, code) if code else f
            )
        out.append(
            ThreadStack(t.thread_id, t.os_thread_id, t.name, t.active, t.owns_gil, tuple(frames))
        )
    return out
