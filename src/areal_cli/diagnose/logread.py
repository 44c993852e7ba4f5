"""Reading a whole log for `doctor why`, however long, in bounded memory and at the speed of
a byte scan.

A failure is not always at a log's end: a traceback followed by gigabytes of other lines (a
server that logged on, a job restarted in the same file) must still be found. The file is
read front to back in blocks of about BLOCK bytes, cut at line ends. The rules (a Python
regex pass per line, about 10 µs a line) see:

- every block that holds a failure mark (MARKS, looked for in the lowered bytes: a traceback,
  an error, a signal, a kill, an OOM, ...) and the block before it (an event may start lines
  before its mark: a traceback pasted without its header starts at a frame), each with
  CONTEXT lines of its neighbours around it, so an event that starts in it is parsed whole;
- the last TAIL bytes in full, whatever they hold (what the doctor read before this module,
  so a rule whose lines carry no mark still works at the end).

A block with no mark is scanned, never parsed: nothing the rules look for starts there. An
event belongs to the block its first line is in, so none is counted twice. Line numbers are
the file's own (lines end at newlines, as editors count); within a block the rules get the
lines that str.splitlines gives, as reading the file whole would. A line longer than
MAX_LINE characters is cut there (a file with no newline at all is read as one cut line).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from areal_cli import files

BLOCK = 1 << 20
TAIL = 4 << 20
CONTEXT = 2_000  # lines of each neighbour around a block: longer than any traceback
MAX_LINE = 64 * 1024
# Lowercase: what the first line of every failure the rules know holds: a traceback's header,
# exception names (…Error, …Exception, …Failure, …Fault, …Abort), signals and kills (SIGTERM,
# the OOM killer), timeouts, C++'s "terminate called", torchrun's FAILED report, Slurm's
# CANCELLED (DUE TO TIME LIMIT, PREEMPTION), exit codes. Broad on purpose: a block wrongly
# marked is only parsed for nothing. Each costs a scan of the block: keep the list short.
MARKS = (
    b"error", b"traceback", b"exception", b"fail", b"kill", b"sig", b"abort", b"fatal",
    b"oom", b"timeout", b"timed out", b"terminat", b"fault", b"exit", b"cancel", b"preempt",
)  # fmt: skip
_OTHER_BREAKS = re.compile("[\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


def not_a_log(path: str | Path) -> str | None:
    """Why `path` cannot be read as a log (no such file, a folder, a device, a FIFO, a socket),
    or None for a regular file. Never opens it: opening a FIFO waits for a writer."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "no such log file"
    except OSError as e:
        return f"cannot read it: {e.strerror}"
    if stat.S_ISREG(st.st_mode):
        return None
    return f"not a regular file ({files.kind_of(st.st_mode)})"


def blocks(f) -> Iterator[bytes]:
    """The bytes of a binary file in pieces of about BLOCK that end at a newline (the last one
    perhaps not); a line longer than MAX_LINE keeps its first MAX_LINE bytes only."""
    carry = b""
    skipping = False  # inside a line already cut at MAX_LINE: drop the rest of it
    while True:
        block = f.read(BLOCK)
        if not block:
            break
        cut = block.rfind(b"\n")
        if cut < 0:
            if not skipping:
                carry += block
                if len(carry) > MAX_LINE:
                    carry, skipping = carry[:MAX_LINE], True
            continue
        if skipping:
            done = carry + block[block.find(b"\n") : cut + 1]
            skipping = False
        else:
            done = carry + block[: cut + 1]
        carry = block[cut + 1 :]
        yield done
    if carry:
        yield carry


def marked(block: bytes) -> bool:
    low = block.lower()
    return any(m in low for m in MARKS)


def _lines(block: bytes) -> list[str]:
    """The block's lines (split at newlines), each cut at MAX_LINE."""
    out = block.decode("utf-8", "replace").split("\n")
    if out and out[-1] == "" and block.endswith(b"\n"):
        out.pop()
    if any(len(s) > MAX_LINE for s in out):
        out = [s[:MAX_LINE] for s in out]
    return out


def _for_rules(lines: list[str]) -> tuple[list[str], list[int] | None]:
    """The lines as str.splitlines gives them (a CR, a form feed... also end a line) and, where
    that differs, the newline-line each comes from."""
    if not any(_OTHER_BREAKS.search(s) for s in lines):
        return lines, None
    out: list[str] = []
    index: list[int] = []
    for i, s in enumerate(lines):
        parts = s.splitlines() or [""]
        out += parts
        index += [i] * len(parts)
    return out, index


def parse_whole(path: str | Path, parse: Callable[[list[str]], list[Any]]) -> list[Any]:
    """Every event of the log at `path`: parse(lines) over its marked blocks and its end, each
    event's `line` (1-based) made the file's own, events in the file's order."""
    out: list[Any] = []
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        it = blocks(f)
        prev: bytes = b""
        cur = next(it, None)
        cur_marked = cur is not None and marked(cur)
        first = 0  # lines before `cur`
        offset = 0  # bytes before `cur`
        while cur is not None:
            nxt = next(it, None)
            nxt_marked = nxt is not None and marked(nxt)
            n = cur.count(b"\n") + (0 if cur.endswith(b"\n") else 1)
            # The block before a mark too: an event may start lines before its mark (a
            # traceback pasted without its header starts at a frame).
            if cur_marked or nxt_marked or offset + len(cur) > size - TAIL:
                before = _lines(prev)[-CONTEXT:] if prev else []
                after = _lines(nxt)[:CONTEXT] if nxt else []
                window = before + _lines(cur) + after
                rules, index = _for_rules(window)
                start = first - len(before)
                for e in parse(rules):
                    if e.line is not None:
                        e.line = start + (index[e.line - 1] if index else e.line - 1) + 1
                        if not first < e.line <= first + n:
                            continue  # a neighbour's: it starts in a margin
                    out.append(e)
            prev, cur, cur_marked = cur, nxt, nxt_marked
            first += n
            offset += len(prev)
    return out
