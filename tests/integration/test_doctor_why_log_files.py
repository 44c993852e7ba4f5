"""`areal doctor why --log` on what is not a log file, and on a log whose failure is far from
its end: the real command on real files, FIFOs and devices."""

from __future__ import annotations

import json
import os

import pytest

from areal_cli.diagnose import logread
from tests.helpers import areal

TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/home/u/train.py", line 30, in main\n'
    "    loss = step(batch)\n"
    "RuntimeError: shape mismatch in step\n"
)


def test_a_traceback_followed_by_megabytes_of_other_lines_is_the_root_cause(tmp_path):
    log = tmp_path / "train.log"
    filler = "".join(f"step {i} loss=0.{i % 97:02d} reward=0.5\n" for i in range(5000))
    with open(log, "w") as f:
        f.write("starting\n" + TRACEBACK)
        while f.tell() < logread.TAIL + (5 << 20):  # past what is read in full
            f.write(filler)
    res = areal("doctor", "why", "--log", str(log), "--json", timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    root = json.loads(res.stdout)["root_cause"]
    assert root["kind"] == "python_exception"
    assert root["message"] == "RuntimeError: shape mismatch in step"
    assert root["where"] == "/home/u/train.py:30" and root["line"] == 2


@pytest.mark.parametrize("what", ["fifo", "device", "folder"])
def test_what_is_not_a_regular_file_exits_2_and_never_blocks(tmp_path, what):
    if what == "fifo":
        target = tmp_path / "pipe"
        os.mkfifo(target)  # no writer ever comes: opening it would wait forever
        kind = "a FIFO"
    elif what == "device":
        target, kind = "/dev/zero", "a device"
    else:
        target, kind = tmp_path, "a folder"
    res = areal("doctor", "why", "--log", str(target), timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"not a regular file ({kind}): {target}" in res.stderr
    assert "Traceback" not in res.stderr


def test_a_missing_log_still_says_so(tmp_path):
    res = areal("doctor", "why", "--log", str(tmp_path / "nope.log"), timeout=60)
    assert res.returncode == 2
    assert f"no such log file: {tmp_path / 'nope.log'}" in res.stderr
