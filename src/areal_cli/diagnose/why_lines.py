"""Log lines as they come from the field, made readable for `doctor why`: the prefixes that
launchers, loggers and pastes put before what a process wrote, and the shape of an exception
line.

    split_line("(VllmWorker rank=2 pid=405) ERROR 07-23 19:34:51 [x.py:487] RuntimeError: …")
    -> Line(stream=(2, "VllmWorker pid=405"), rank=2, text="RuntimeError: …", head="…")

A prefix that a process puts on every line (torch's `[rankN]:`, vLLM's and Ray's
`(Name rank=N pid=P)`) names the stream the line belongs to; one that only the first line of a
message carries (SGLang's `[time TPn]`) names the rank of what starts there, while the lines
that follow it (a traceback) stay in their stream.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ANSI = re.compile(r"(?:\x1b|\^\[)\[[\d;]*m|^\[\d{1,2}(?:;\d+)*m")
_FENCE = re.compile(r"^\s*`{3,}[\w!/.+-]*\s*$")  # a Markdown code fence in a paste
_GLUED_FENCE = re.compile(r"^`{3}(?=\S)|`{3}\s*$")
_QUOTE = re.compile(r"^(?:>(?: |$))+")  # a reply that quotes the log
# A process's tag on each of its lines: vLLM `(VllmWorker rank=2 pid=405)`, Ray
# `(WorkerDict pid=616, ip=192.168.1.2)`, `(raylet)`, `(pid=123)`.
_TAG = re.compile(
    r"^\((?P<name>[A-Za-z_][\w.:-]*)?\s*(?:rank=(?P<rank>\d+)\s*)?(?:pid=(?P<pid>\d+))?"
    r"(?:,\s*ip=[^)]*)?\)\s?"
)
# Headers a logger or a container runtime writes before a line; one space after them is theirs.
_HEADS = (
    re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z?\s"),  # docker / kubectl logs
    re.compile(r"^[\w.-]+\s+\|\s"),  # docker compose
    # vLLM: `ERROR 07-23 19:34:51 [multiproc_executor.py:487] ` (older: no brackets)
    re.compile(
        r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? "
        r"\[?[\w./-]+:\d+\] ?"
    ),
    # Python logging's `2025-03-08 02:04:48,693 - __main__ - INFO - `
    re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ - [\w.]+ - [A-Z]+ - "),
)
# SGLang: `[2025-11-03 18:48:34 TP7] ` (also `DP0 TP0 EP0`, `PP0`): the TP rank of what follows.
_SGLANG = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?(?P<parts>(?: [A-Z]{2}\d+)+)\] ")
# torch's `[rankN]:` (torchrun `--tee`'s `[defaultN]:`), after at most a short header of
# digits and punctuation (a timestamp, a line number a log viewer added).
_RANK = re.compile(r"^(?P<head>[\s\d\[\]:.,TZ/-]{0,40}?)\[(?:default|rank)(?P<rank>\d+)\]:\s?")


@dataclass
class Line:
    stream: tuple  # (rank, tag): the lines of one process, in their order
    rank: int | None  # the rank this line speaks for
    text: str  # what the process wrote, its indentation kept
    head: str  # the prefixes taken off (a timestamp may be in them)


def split_line(raw: str, rank: int | None = None) -> Line | None:
    """The prefixes off one raw line; None for a line that is only a paste's artefact."""
    text = raw.rstrip("\r\n")
    if "\x1b" in text or "^[" in text or (text[:1] == "[" and text[1:2].isdigit()):
        text = _ANSI.sub("", text)  # colours, or their codes left in a paste
    if "```" in text:
        if _FENCE.match(text):
            return None
        text = _GLUED_FENCE.sub("", text)  # a fence glued to a line
    if text.startswith("`") and not text.startswith("``"):
        text = text[1:].removesuffix("`")  # inline code around a pasted line
    if text.startswith("**") and text.rstrip().endswith("**") and len(text.strip()) > 4:
        text = text.strip()[2:-2]  # a line a paste set in bold
    head, tag, line_rank = "", None, None
    while text:
        before = text
        first = text[0]
        if first == ">":
            m = _QUOTE.match(text)
            if m and m.end():
                text = text[m.end() :]
        elif first == "(":
            m = _TAG.match(text)
            if m and (m.group("name") or m.group("pid")):
                parts = [m.group("name"), f"pid={m.group('pid')}" if m.group("pid") else None]
                tag = " ".join(p for p in parts if p)
                if m.group("rank") is not None:
                    rank = int(m.group("rank"))
                head, text = head + text[: m.end()], text[m.end() :]
        # (each pattern only where its first character could start it: most lines have none)
        if first.isdigit() or first in "DIWEC" or "|" in text[:40]:
            for rx in _HEADS:
                m = rx.match(text)
                if m:
                    head, text = head + text[: m.end()], text[m.end() :]
        if "[" in text[:48]:
            m = _SGLANG.match(text) if first == "[" and text[1:2].isdigit() else None
            if m:
                tp = re.search(r"TP(\d+)", m.group("parts"))
                line_rank = int(tp.group(1)) if tp else line_rank
                head, text = head + text[: m.end()], text[m.end() :]
            m = _RANK.match(text)
            if m:
                rank = int(m.group("rank"))
                head, text = head + text[: m.end()], text[m.end() :]
        if text == before:
            break
    return Line((rank, tag), line_rank if line_rank is not None else rank, text, head)


# An exception line: `ValueError: msg`, `torch.OutOfMemoryError: msg`, `ncclSystemError: msg`,
# `ray.exceptions.RayTaskError(ActorDiedError): msg`, a bare `AssertionError`.
_EXC = re.compile(
    r"^(?P<name>(?:[A-Za-z_]\w*\.)*(?P<cls>[A-Za-z_]\w*)(?:\((?P<inner>[\w.]+)\))?)"
    r"(?P<colon>:(?:\s(?P<msg>.*))?)?$"
)
_EXC_CLASS = re.compile(r"(?:Error|Exception|Exit|Interrupt|Failure|Fault|Abort)$")


def exception_line(text: str, strict: bool = False) -> re.Match | None:
    """The match when `text` reads as the last line of a traceback: `Name: message` where Name
    looks like an exception class. `strict` (a line outside any traceback): the class must
    say it is an error and carry a message."""
    m = _EXC.match(text.strip())
    if m is None:
        return None
    cls = m.group("cls")
    if cls.endswith("Warning"):
        return None
    named = bool(_EXC_CLASS.search(cls)) or cls in ("StopIteration", "KeyboardInterrupt")
    if strict:
        return m if named and m.group("msg") else None
    if named or (m.group("colon") and cls[:1].isupper() and "." in m.group("name")):
        return m
    return None


# A line inside a traceback that is none of its content: carets under the code (3.11+),
# an elision, a repeat count.
_FILLER = re.compile(r"^\s*(?:[\^~]+|\[\.\.\.\]|\.\.\.|\[Previous line repeated .*\])\s*$")


def filler(text: str) -> bool:
    return bool(_FILLER.match(text))
