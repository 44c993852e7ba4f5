"""py-spy output parsing and error classification."""

from __future__ import annotations

import json
import os

from areal_cli.diagnose import stacks

# Recorded from `py-spy dump --json` (py-spy 0.4.3) on a rank blocked in a gloo all_reduce.
RECORDED = [
    {
        "pid": 4837,
        "thread_id": 140093214508864,
        "thread_name": "MainThread",
        "os_thread_id": 4837,
        "active": False,
        "owns_gil": False,
        "frames": [
            {
                "name": "all_reduce",
                "filename": "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py",
                "module": None,
                "short_filename": "torch/distributed/distributed_c10d.py",
                "line": 3252,
                "locals": None,
                "is_entry": False,
                "is_shim_entry": False,
            },
            {
                "name": "step",
                "filename": "/tmp/s1.py",
                "module": None,
                "short_filename": "s1.py",
                "line": 8,
                "locals": [{"name": "t", "addr": 1, "arg": True, "repr": "tensor([1.])"}],
                "is_entry": False,
                "is_shim_entry": False,
            },
        ],
        "process_info": None,
    }
]


def test_parse_recorded_output():
    threads = stacks.parse_pyspy_json(json.dumps(RECORDED))
    assert len(threads) == 1
    t = threads[0]
    assert t.name == "MainThread" and t.os_thread_id == 4837 and not t.active
    assert [f.function for f in t.frames] == ["all_reduce", "step"]
    assert t.frames[1].where() == "s1.py:8"
    assert t.frames[1].locals == (("t", "tensor([1.])"),)
    d = stacks.Dump(pid=4837, threads=threads)
    assert d.main_thread() is t


def test_error_lines_and_kinds():
    stderr = (
        "Error: Failed to get process executable name. Check that the process is running.\n\n"
        "Caused by:\n    0: Permission denied (os error 13)\n"
    )
    line = stacks._first_error_line(stderr)
    assert line.startswith("Failed to get process executable name")
    assert "Permission denied (os error 13)" in line
    assert stacks.classify_error(stderr, os.getpid()) == "permission"
    assert (
        stacks.classify_error("Error: Unsupported version of Python: 3.99", os.getpid())
        == "version"
    )
    assert stacks.classify_error("anything", 2**22 + 12345) == "gone"


def test_pyspy_is_found_next_to_the_interpreter():
    exe = stacks.find_pyspy()
    assert exe is not None and exe.endswith("py-spy")


def test_a_thread_did_not_run_when_its_counters_stand_still():
    before = {1: (500, 10), 2: (900, 7)}
    assert stacks.did_not_run(before, dict(before), frozenset())
    assert not stacks.did_not_run(before, {1: (501, 10), 2: (900, 7)}, frozenset())
    assert not stacks.did_not_run(before, {1: (500, 11), 2: (900, 7)}, frozenset())
    assert not stacks.did_not_run(before, {1: (500, 10)}, frozenset())  # a thread ended


def test_a_resume_counted_ahead_is_not_taken_for_activity():
    # Thread 1 was still to resume its wait when the dump ended: its run was counted ahead.
    before = {1: (500, 10), 2: (900, 7)}
    resumed = {1: (530, 10), 2: (900, 7)}  # the resume took CPU time, nothing else ran
    already = {1: (500, 9), 2: (900, 7)}  # the resume had been counted before the reading
    again = {1: (560, 11), 2: (900, 7)}  # it ran once more: its own activity
    assert stacks.did_not_run(before, resumed, frozenset({1}))
    assert stacks.did_not_run(before, already, frozenset({1}))
    assert not stacks.did_not_run(before, again, frozenset({1}))


def test_the_dumps_types_are_reached_through_stacks():
    from areal_cli.diagnose import dumps

    assert stacks.Dump is dumps.Dump and stacks.Frame is dumps.Frame
    assert stacks.parse_pyspy_json is dumps.parse_pyspy_json
    try:
        stacks.NoSuchName  # noqa: B018
    except AttributeError as e:
        assert "NoSuchName" in str(e)
    else:
        raise AssertionError("stacks.NoSuchName resolved")


def test_rank_records_compare_and_print_as_dataclasses_did():
    from areal_cli.diagnose.targets import Job, RankProc

    a = RankProc(pid=5, rank=0, local_rank=0, world_size=2, local_world_size=2, cmdline=["x"])
    b = RankProc(5, 0, 0, 2, 2, ["x"])
    assert a == b and a.env == {} and a.env is not b.env and a.node is None
    assert a != RankProc(6, 0, 0, 2, 2, ["x"])
    assert repr(a).startswith("RankProc(pid=5, rank=0, ") and "node=None" in repr(a)
    j = Job(label="pids 5", ranks=[a])
    assert j == Job("pids 5", [b], reach=print)  # reach is neither compared nor shown
    assert "reach" not in repr(j) and j.nodes == {} and j.lead == 0.5
    assert j.world_size == 2 and j.expected_local_ranks() == [0, 1]
