"""The hang verdicts as a table (hang_rules.RULES, one judge per row in verdict.py), and the
evidence that the stacks alone do not show: collectives torch issues from C++ (inside backward,
DDP's forward), point-to-point cycles, and ops that differ at one collective number.

Stacks are py-spy's format as in test_doctor_verdict; the recorder's answers are the channel's
real ones (tests/fixtures/flight/) from tests/scenarios/field_threads_out_of_order.py and
wrong_group.py while they hung.
"""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from test_doctor_flight_rules import answers, flights
from test_doctor_verdict import (
    SITE,
    dump,
    fr,
    idle_on_queue,
    one,
    samples,
    spinning,
    user,
    waiting,
)

from areal_cli.diagnose import flight, hang_rules, verdict
from areal_cli.diagnose.verdict import analyze

AREAL = str(Path(sys.executable).parent / "areal")


def with_code(d, code: str):
    """The dump with its innermost frame's source line set (as `with_source` reads it)."""
    t = d.threads[0]
    frames = (replace(t.frames[0], code=code), *t.frames[1:])
    return replace(d, threads=[replace(t, frames=frames), *d.threads[1:]])


def test_every_row_has_a_judge_and_every_judge_a_row():
    assert set(verdict.JUDGES) == {r.kind for r in hang_rules.RULES}
    assert len({r.priority for r in hang_rules.RULES}) == len(hang_rules.RULES)
    assert all(r.advice in hang_rules.ADVICE and r.why and r.means for r in hang_rules.RULES)
    assert verdict.KINDS == hang_rules.KINDS and verdict.HANGS == hang_rules.HANGS
    table = hang_rules.markdown().splitlines()[2:]  # docs/doctor.md's table, from the rows
    assert [line.split("`")[1] for line in table] == list(hang_rules.KINDS)


def test_no_function_of_the_verdict_is_over_80_lines():
    tree = ast.parse(inspect.getsource(verdict))
    long = [
        (n.name, n.end_lineno - n.lineno + 1)
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef) and n.end_lineno - n.lineno + 1 > 80
    ]
    assert long == []


def test_help_lists_every_kind_from_the_table():
    res = subprocess.run([AREAL, "doctor", "hang", "--help"], capture_output=True, text=True,
                         timeout=60, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())
    listed = re.search(r"Verdicts, in the order they are tried: ([\w, ]+)\.", text)
    assert listed and listed.group(1).split(", ") == list(hang_rules.KINDS)


def test_every_verdict_carries_the_advice_of_its_row():
    v = analyze(one(waiting(1), waiting(2), idle_on_queue(3))).verdict
    row = hang_rules.BY_KIND[v.kind]
    assert (v.advice, v.advice_reason) == (row.advice, row.why)
    assert v.to_json()["advice"] == {"action": "stop", "reason": row.why}


# --------------------------------------------------------------------------- torch's C++ side

BACKWARD = [
    fr("_engine_run_backward", f"{SITE}/torch/autograd/graph.py", 829),
    fr("backward", f"{SITE}/torch/autograd/__init__.py", 354),
    fr("Tensor.backward", f"{SITE}/torch/_tensor.py", 647),
]


def in_backward(pid: int, active: bool = False):
    return dump(pid, BACKWARD + user("train", 27), active=active)


def test_idle_in_backward_waits_in_the_collective_ddp_issues_from_cpp():
    # DDP's reducer all-reduces the buckets from C++: the Python stack ends in autograd. Read
    # as idle, the waiting ranks were the odd ones and the rank that skipped was named waiting.
    a = analyze(one(in_backward(1), in_backward(2), idle_on_queue(3, "save_checkpoint", 23)))
    assert [r.collective for r in a.ranks] == ["backward", "backward", None]
    assert a.verdict.kind == "mismatched_collective" and a.verdict.odd_ranks == [2]
    assert "inside backward" in a.verdict.evidence[0]
    assert [r.inferred for r in a.ranks] == [True, True, False]
    twice = analyze(samples(*[[d, d] for d in (in_backward(1), in_backward(2), idle_on_queue(3))]))
    assert "ranks 0-1 wait where torch issues a collective from C++" in twice.verdict.certainty


def test_with_native_frames_the_reducer_names_the_backward_wait():
    native = [
        {**fr("pthread_cond_wait", "?", 0), "filename": "?", "short_filename": "?"},
        fr("c10d::Reducer::finalize_backward", "?", 0),
    ]
    d = dump(1, native + BACKWARD + user("train", 27))
    d = replace(d, threads=[replace(d.threads[0], frames=tuple(
        replace(f, native=i < 2) for i, f in enumerate(d.threads[0].frames)))])  # fmt: skip
    a = analyze(one(d, d, idle_on_queue(3)))
    assert [(r.collective, r.inferred) for r in a.ranks[:2]] == [("backward", False)] * 2
    assert a.verdict.kind == "mismatched_collective" and a.verdict.odd_ranks == [2]


def test_a_rank_computing_its_backward_is_busy_not_waiting():
    a = analyze(one(in_backward(1, active=True), waiting(2, "barrier")))
    assert a.ranks[0].state == "busy" and a.verdict.kind == "straggler"
    assert a.verdict.odd_ranks == [0]


def test_ddp_forward_waits_in_the_broadcast_of_its_rebuilt_buckets():
    frames = [
        fr("DistributedDataParallel._pre_forward", f"{SITE}/torch/nn/parallel/distributed.py",
           1775),
        fr("DistributedDataParallel.forward", f"{SITE}/torch/nn/parallel/distributed.py", 1886),
    ]  # fmt: skip
    line = "if torch.is_grad_enabled() and self.reducer._rebuild_buckets():"
    d = [with_code(dump(p, frames + user("train_step", 22)), line) for p in (1, 2)]
    a = analyze(one(waiting(0, "barrier"), *d))
    assert [r.collective for r in a.ranks] == ["barrier", "broadcast", "broadcast"]
    assert a.verdict.kind == "collective_type_mismatch" and a.verdict.odd_ranks == [0]


def test_a_background_thread_in_a_collective_is_the_ranks_place():
    def rank(pid: int, in_collective: bool):
        bg = [fr("Queue.get", "/usr/lib/python3.11/queue.py", 171)]
        if in_collective:
            bg = [fr("all_reduce", f"{SITE}/torch/distributed/distributed_c10d.py", 3252)]
        thread = {"pid": pid, "thread_id": 2, "thread_name": "metrics", "os_thread_id": pid + 1,
                  "active": False, "owns_gil": False, "process_info": None,
                  "frames": bg + [fr("metrics_worker", "/home/me/train.py", 26)]}  # fmt: skip
        main = [fr("Event.wait", "/usr/lib/python3.11/threading.py", 629)]
        return dump(pid, main + user("wait_for_metrics", 31), extra_threads=[thread])

    a = analyze(one(rank(10, True), rank(20, True), rank(30, False)))
    assert [r.thread for r in a.ranks] == ["metrics", "metrics", "MainThread"]
    assert a.verdict.kind == "mismatched_collective" and a.verdict.odd_ranks == [2]


# --------------------------------------------------------------------------- point to point


def test_every_rank_in_a_recv_is_a_cycle_not_a_transport_problem():
    a = analyze(one(waiting(1, "recv", 3000), waiting(2, "recv", 3000)))
    v = a.verdict
    assert v.kind == "p2p_cycle" and v.odd_ranks == [] and v.candidates == [0, 1]
    assert v.advice == "stop"
    # With ranks on other hosts not looked at, the peer may be there.
    results = analyze(one(waiting(1, "recv", 3000), waiting(2, "recv", 3000)), multi_host=True)
    assert results.verdict.kind == "collective_stuck"


# --------------------------------------------------------------------------- flight recorder


def test_threads_issuing_in_a_rank_dependent_order_show_as_different_ops_at_one_number():
    raw = answers("threads_out_of_order")
    got = flight.ops_disagree(list(flights(raw).values()))
    assert got is not None
    first, per_rank = got
    assert first.seq == 2 and {r: e.op for r, e in per_rank.items()} == {
        0: "all_reduce", 1: "all_reduce", 2: "all_gather"
    }  # fmt: skip
    # Every rank's main thread waits in work.wait(): the stacks agree.
    stacks = one(
        *[with_code(dump(100 + r, user("sync_grads", 31)), "work.wait()") for r in range(3)]
    )
    assert analyze(stacks).verdict.kind == "collective_stuck"
    v = analyze(stacks, flights=flights(raw)).verdict
    assert v.kind == "collective_type_mismatch" and v.odd_ranks == [2]
    assert "collective #2 of group default_pg is a different op" in v.summary


def test_without_the_recorder_several_threads_in_collectives_are_named_as_a_doubt():
    def rank(pid: int):
        bg = {"pid": pid, "thread_id": 2, "thread_name": "comm", "os_thread_id": pid + 1,
              "active": False, "owns_gil": False, "process_info": None,
              "frames": [fr("all_gather_into_tensor",
                            f"{SITE}/torch/distributed/distributed_c10d.py", 4000),
                         fr("gather_stats", "/home/me/train.py", 40)]}  # fmt: skip
        main = [fr("all_reduce", f"{SITE}/torch/distributed/distributed_c10d.py", 3252),
                fr("sync_grads", "/home/me/train.py", 31)]  # fmt: skip
        return dump(pid, main, extra_threads=[bg])

    a = analyze(one(rank(10), rank(20), rank(30)))
    assert [r.collective_threads for r in a.ranks] == [2, 2, 2]
    assert a.verdict.kind == "collective_stuck" and a.verdict.odd_ranks == []
    assert "several threads in collectives" in a.verdict.summary


def test_wrong_group_between_two_ranks_names_nobody():
    v = analyze(one(waiting(100, line=14), waiting(101, line=14)),
                flights=flights(answers("wrong_group"))).verdict  # fmt: skip
    assert v.kind == "wrong_group" and v.odd_ranks == [] and v.candidates == [0, 1]


def test_wrong_group_whose_every_member_waits_in_it_is_the_consistent_one():
    # Group "pair" = {0, 1}: both its members wait in it. Rank 2 waits in the world's group,
    # where ranks 0 and 1 never come; by count it is a tie-free 2 against 1 either way, and
    # the membership says which side is whole.
    def rf(rank: int, pg: str, desc: str) -> flight.RankFlight:
        e = flight.Entry(pg=pg, desc=desc, seq=1, op="all_reduce", input_sizes=((4,),),
                         dtypes=("Float",), state="scheduled")  # fmt: skip
        groups = {"0": {"desc": "default_pg", "ranks": [0, 1, 2]},
                  "1": {"desc": "pair", "ranks": [0, 1]}}  # fmt: skip
        return flight.RankFlight(rank=rank, pid=100 + rank, entries=[e], groups=groups)

    fl = {0: rf(0, "1", "pair"), 1: rf(1, "1", "pair"), 2: rf(2, "0", "default_pg")}
    v = analyze(one(waiting(100), waiting(101), waiting(102)), flights=fl).verdict
    assert v.kind == "wrong_group" and v.odd_ranks == [2] and v.candidates == []


def test_a_healthy_loop_of_collectives_is_still_no_hang():
    v = analyze(
        [
            verdict.RankSamples(0, 1, [spinning(1, 30, "a"), spinning(1, 31, "b")]),
            verdict.RankSamples(1, 2, [spinning(2, 30, "a"), spinning(2, 31, "b")]),
        ]
    ).verdict
    assert v.kind == "no_hang" and not v.is_hang
