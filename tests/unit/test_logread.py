"""diagnose.logread: a log read whole, in blocks, finds what reading it at once finds, at the
file's own line numbers, wherever the failure sits in it."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_cli.diagnose import logread, why
from tests.helpers import REPO

FIXTURES = sorted(
    [*(REPO / "tests" / "fixtures" / "logs").glob("*.log"),
     *(REPO / "tests" / "fixtures" / "why").glob("*.log")]
)  # fmt: skip
FILLER = "".join(f"step {i} loss=0.{i % 97:02d} reward=0.5 tokens=4096\n" for i in range(800))


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of a few lines and no tail read in full: every failure is found by its mark and
    many straddle a block's end."""
    monkeypatch.setattr(logread, "BLOCK", 2048)
    monkeypatch.setattr(logread, "TAIL", 0)
    monkeypatch.setattr(logread, "CONTEXT", 300)


def _events(evs) -> list[tuple]:
    return [(e.kind, e.line, e.message, e.where, e.rank) for e in evs]


@pytest.mark.parametrize("log", FIXTURES, ids=lambda p: p.name)
def test_blocks_find_what_the_whole_file_shows(small_blocks, tmp_path, log):
    # Every recorded real log, between lines that mark nothing (skipped unparsed).
    text = FILLER + log.read_text(errors="replace") + FILLER
    path = tmp_path / log.name
    path.write_text(text)
    year = why._time.localtime(path.stat().st_mtime).tm_year
    whole = why.parse_log(log.name, text.splitlines(), rank=why.label_rank(log.stem), year=year)
    got = why.parse_files([(log.stem, path)])
    assert _events(got) == _events(whole)


def test_a_traceback_before_megabytes_of_other_lines_is_found(tmp_path):
    path = tmp_path / "train.log"
    tb = (
        "Traceback (most recent call last):\n"
        '  File "/home/u/train.py", line 30, in main\n'
        "    loss = step(batch)\n"
        "RuntimeError: shape mismatch in step\n"
    )
    with open(path, "w") as f:
        f.write("starting\n" + tb)
        while f.tell() < logread.TAIL + (5 << 20):  # past what is read in full
            f.write(FILLER)
    rep = why.analyze(why.parse_files([("train", path)]))
    assert rep.root is not None and rep.root.kind == "python_exception"
    assert rep.root.message == "RuntimeError: shape mismatch in step"
    assert rep.root.where == "/home/u/train.py:30" and rep.root.line == 2


def test_line_numbers_are_the_files_with_carriage_returns(small_blocks, tmp_path):
    # A progress bar redraws with CR; a Windows copy ends lines with CRLF. The number is the
    # line an editor shows (newlines counted).
    bar = "".join(f"\r{i}%|###" for i in range(0, 100, 5)) + "\n"
    text = FILLER.replace("\n", "\r\n") + bar * 40 + "Traceback (most recent call last):\r\n"
    text += '  File "/w/x.py", line 3, in f\r\n    g()\r\nValueError: bad\r\n' + FILLER
    path = tmp_path / "crlf.log"
    path.write_text(text, newline="")
    (ev,) = why.parse_files([("crlf", path)])
    assert ev.kind == "python_exception" and ev.message == "ValueError: bad"
    assert ev.line == text.split("\n").index("Traceback (most recent call last):\r") + 1


def test_a_line_without_end_is_cut_not_loaded_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(logread, "BLOCK", 4096)
    path = tmp_path / "one-line.log"
    with open(path, "wb") as f:
        f.write(b"x" * (3 * logread.MAX_LINE))
        f.write(b"\nsecond\n" + b"y" * (2 * logread.MAX_LINE))
    with open(path, "rb") as f:
        got = b"".join(logread.blocks(f)).split(b"\n")
    assert [len(s) for s in got] == [logread.MAX_LINE, 6, logread.MAX_LINE]
    assert got[1] == b"second"


@pytest.mark.parametrize("make", ["folder", "fifo", "device", "missing", "file"])
def test_what_is_not_a_regular_file_is_named_without_opening_it(tmp_path, make):
    import os

    p: str | Path = tmp_path / "x"
    if make == "folder":
        p.mkdir()
    elif make == "fifo":
        os.mkfifo(p)  # opening it would wait for a writer
    elif make == "device":
        p = "/dev/zero"
    elif make == "file":
        p.write_text("ok\n")
    said = logread.not_a_log(p)
    want = {
        "folder": "not a regular file (a folder)",
        "fifo": "not a regular file (a FIFO)",
        "device": "not a regular file (a device)",
        "missing": "no such log file",
        "file": None,
    }[make]
    assert said == want
