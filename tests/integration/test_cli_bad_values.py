"""Values that name nothing, given to real commands: a nan or infinite duration, an empty
output folder, a --home that is empty or not a folder. Each is one message and exit 2, and
nothing is written or recorded anywhere (before, `-o ''` profiled into the current folder and
`ps --home /dev/null` said "no jobs running")."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from areal_cli import procs
from tests.helpers import areal


@pytest.fixture
def python_target(tmp_path):
    """A live Python process that `doctor profile --pid` accepts as a rank; killed after."""
    proc = procs.spawn(
        [sys.executable, "-c", "import time\nwhile True: time.sleep(0.01)"],
        env=dict(os.environ),
        stdout=subprocess.DEVNULL,
    )
    try:
        yield proc.pid
    finally:
        procs.terminate(procs.tree([proc.pid]), grace=2.0)
        proc.wait()


@pytest.mark.parametrize("duration", ["nan", "inf"])
def test_profile_refuses_a_duration_that_is_not_finite(duration, python_target, tmp_path):
    out = tmp_path / "prof"
    res = areal("doctor", "profile", "--pid", str(python_target), "-d", duration, "-o", str(out),
                check=2, timeout=120)  # fmt: skip
    assert "--duration" in res.stderr and "Traceback" not in res.stderr
    assert not out.exists()


def test_profile_refuses_an_empty_output_folder(python_target, tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    res = areal("doctor", "profile", "--pid", str(python_target), "-d", "0.5", "-o", "",
                check=2, cwd=cwd, timeout=120)  # fmt: skip
    assert "'--out' / '-o': an empty path" in res.stderr
    assert list(cwd.iterdir()) == []  # nothing profiled into the current folder


def test_hang_refuses_an_empty_output_folder_and_an_infinite_interval(python_target, tmp_path):
    # `doctor hang` parses plain flags without typer: the same values take typer's message.
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    res = areal("doctor", "hang", "--pid", str(python_target), "--out", "", check=2, cwd=cwd)
    assert "'--out': an empty path" in res.stderr
    res = areal("doctor", "hang", "--pid", str(python_target), "--interval", "inf", check=2)
    assert "'--interval': 'inf' is not a finite number" in res.stderr
    assert list(cwd.iterdir()) == []


HOME_COMMANDS = [
    ("ps",),
    ("ps", "--all", "--json"),
    ("logs", "e/t"),
    ("stop", "e/t"),
    ("key", "e/t"),
    ("doctor", "hang"),
    ("doctor", "why", "e/t"),
    ("doctor", "check"),
    ("doctor", "memory", "--job", "e/t"),
    ("serve", "--backend", "hf", "--model", "m", "--dry-run"),
]


@pytest.mark.parametrize("args", HOME_COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_every_home_option_refuses_what_is_not_a_folder(args, tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for home, reason in [
        ("", "empty"),
        ("/dev/null", "--home /dev/null is not a folder"),
        ("/dev/null/sub", "lies under /dev/null, which is not a folder"),
    ]:
        res = areal(*args, "--home", home, check=2, cwd=cwd)
        assert reason in res.stderr, (home, res.stderr)
        assert "no jobs" not in res.stdout and "Traceback" not in res.stderr
    assert list(cwd.iterdir()) == []


def test_areal_home_that_is_not_a_folder_is_refused(tmp_path):
    res = areal("ps", env={"AREAL_HOME": "/dev/null"}, check=2)
    assert "AREAL_HOME /dev/null is not a folder" in res.stderr
    # A home that does not exist yet is a home without jobs: `serve` makes it.
    res = areal("ps", env={"AREAL_HOME": str(tmp_path / "new")}, check=0)
    assert "no jobs running" in res.stdout
