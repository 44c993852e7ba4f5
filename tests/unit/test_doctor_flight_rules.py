"""The flight recorder's half of the hang verdicts, on recorded inputs.

tests/fixtures/flight/*.json are the channel's real answers to `fr` (torch 2.13, gloo) from the
scenarios tests/scenarios/shape_mismatch.py and wrong_group.py while they hung; the stacks are
py-spy's format, as in test_doctor_verdict.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from test_doctor_verdict import dump, fr, one, samples, waiting

from areal_cli.diagnose import flight
from areal_cli.diagnose.verdict import analyze

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "flight"


def answers(name: str) -> list[dict]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def flights(raw: list[dict]) -> dict[int, flight.RankFlight]:
    return {a["rank"]: flight.parse(a) for a in raw}


def test_gloo_entries_parse_retired_as_completed_and_the_pending_one_is_found():
    f = flights(answers("shape_mismatch"))
    assert [(e.seq, e.op, e.state) for e in f[0].entries] == [
        (1, "all_reduce", "completed"),
        (2, "all_reduce", "completed"),
        (3, "all_reduce", "scheduled"),
    ]
    assert f[1].pending().seq == 2 and f[1].pending().input_sizes == ((2097152,),)
    assert f[0].groups["0"] == {"desc": "default_pg", "ranks": [0, 1]}


def test_shape_mismatch_names_the_collective_the_sizes_and_where_each_rank_is():
    stacks = one(waiting(100, line=21), waiting(101, line=19))
    without = analyze(stacks)
    assert without.verdict.kind == "collective_stuck"  # the stacks alone cannot tell
    a = analyze(stacks, flights=flights(answers("shape_mismatch")))
    v = a.verdict
    assert v.kind == "shape_mismatch" and v.is_hang
    assert v.odd_ranks == [1]
    assert "collective #2 of group default_pg (all_reduce)" in v.summary
    assert "rank 0 [1048576] Float; rank 1 [2097152] Float" in v.summary
    assert "went on to #3" in v.summary
    assert {r: e.seq for r, e in v.reached.items()} == {0: 3, 1: 2}
    out = v.to_json()
    assert out["reached"]["1"]["input_sizes"] == [[2097152]]
    assert "collective #3 of group default_pg" in v.evidence[0]


def test_wrong_group_names_the_groups_each_rank_waits_in():
    stacks = one(waiting(100, line=14), waiting(101, line=14))
    assert analyze(stacks).verdict.kind == "collective_stuck"
    v = analyze(stacks, flights=flights(answers("wrong_group"))).verdict
    assert v.kind == "wrong_group"
    # One rank in each group, each group's other member in the other: either may be wrong.
    assert v.odd_ranks == [] and v.candidates == [0, 1]
    assert "either side may be the wrong one" in v.summary
    assert "rank 0 in group dp (#1 all_reduce); rank 1 in group tp (#1 all_reduce)" in v.summary
    assert {r: (e.desc, e.seq) for r, e in v.reached.items()} == {0: ("dp", 1), 1: ("tp", 1)}


def test_a_mismatch_every_rank_finished_is_history_not_the_verdict():
    raw = answers("shape_mismatch")
    done = copy.deepcopy(raw)
    seq3 = copy.deepcopy(done[0]["dump"]["entries"][2])
    for e in done[1]["dump"]["entries"]:
        e["retired"] = True
    done[1]["dump"]["entries"].append({**seq3, "record_id": 2})
    v = analyze(one(waiting(100, line=21), waiting(101, line=21)), flights=flights(done)).verdict
    assert v.kind == "collective_stuck"
    assert {r: e.seq for r, e in v.reached.items()} == {0: 3, 1: 3}


def test_a_job_that_moves_is_no_hang_whatever_its_recorder_says():
    moving = [
        [waiting(100, line=21), waiting(100, line=19)],
        [waiting(101, line=19), waiting(101, line=21)],
    ]
    v = analyze(samples(*moving), flights=flights(answers("shape_mismatch"))).verdict
    assert v.kind == "no_hang"
    assert set(v.reached) == {0, 1}  # still says where each rank stood


def test_a_rank_blocked_in_cpp_gets_its_place_from_the_recorder():
    native_only = dump(
        101,
        [
            {**fr("pthread_cond_wait", "libc.so.6", 0), "line": 0},
            {**fr("std::condition_variable::wait", "libstdc++.so.6", 0), "line": 0},
        ],
    )
    stacks = one(waiting(100, line=14), native_only)
    assert analyze(stacks).verdict.kind == "mismatched_collective"
    raw = answers("wrong_group")
    for a in raw:  # both wait in the same group: only the stack of rank 1 is unreadable
        a["dump"]["entries"][1]["process_group"] = ["1", "dp"]
    a = analyze(stacks, flights=flights(raw))
    assert a.ranks[1].state == "collective" and a.ranks[1].collective == "all_reduce"
    assert a.verdict.kind == "collective_stuck"
    assert a.verdict.reached[1].seq == 1


def test_pg_config_is_rebuilt_from_the_groups_the_ranks_know():
    f = flights(answers("wrong_group"))[1]
    # What gloo recorded: its config before c10d named the group (torch's analyzer then
    # raises KeyError: ('0', 0)).
    assert f.raw["pg_config"] == {"": {"desc": "", "name": "", "ranks": "[]"}}
    assert flight.torch_pg_config(f) == {
        "0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"},
        "1": {"name": "1", "desc": "dp", "ranks": "[0, 1]"},
        "2": {"name": "2", "desc": "tp", "ranks": "[0, 1]"},
    }


def test_sizes_that_differ_by_design_are_no_shape_mismatch():
    raw = answers("shape_mismatch")
    for a in raw:  # the same entries, as a scatter: the root's list differs from the others'
        for e in a["dump"]["entries"]:
            e["profiling_name"] = "gloo:scatter"
    v = analyze(one(waiting(100, line=21), waiting(101, line=19)), flights=flights(raw)).verdict
    assert v.kind == "collective_stuck"
