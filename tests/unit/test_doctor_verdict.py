"""Hang verdicts from parsed dumps: the pure half of `areal doctor hang`.

Stacks are written in py-spy's own `dump --json` format (innermost frame first), with the
torch frames a gloo job really shows, and go through the same parser the command uses.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from areal_cli.diagnose.stacks import Dump, Frame, parse_pyspy_json
from areal_cli.diagnose.verdict import (
    RankSamples,
    analyze,
    find_collective,
    user_frame,
)

SITE = "/venv/lib/python3.11/site-packages"
STDLIB = "/usr/lib/python3.11"
USER = "/home/me/train.py"


def fr(name: str, file: str, line: int) -> dict:
    short = file.split("site-packages/")[-1] if "site-packages" in file else file.rsplit("/", 1)[-1]
    return {
        "name": name,
        "filename": file,
        "module": None,
        "short_filename": short,
        "line": line,
        "locals": None,
        "is_entry": False,
        "is_shim_entry": False,
    }


def c10d(name: str, line: int = 3252) -> list[dict]:
    return [
        fr(name, f"{SITE}/torch/distributed/distributed_c10d.py", line),
        fr("_exception_logger.<locals>.wrapper", f"{SITE}/torch/distributed/c10d_logger.py", 83),
    ]


def user(func: str, line: int) -> list[dict]:
    return [fr(func, USER, line), fr("<module>", USER, 99)]


def dump(pid: int, frames: list[dict], active: bool = False, extra_threads=()) -> Dump:
    threads = [
        {
            "pid": pid,
            "thread_id": 1,
            "thread_name": "MainThread",
            "os_thread_id": pid,
            "active": active,
            "owns_gil": active,
            "frames": frames,
            "process_info": None,
        },
        *extra_threads,
    ]
    text = json.dumps(threads)
    return Dump(pid=pid, threads=parse_pyspy_json(text), raw=text)


def waiting(pid: int, coll: str = "all_reduce", line: int = 10) -> Dump:
    return dump(pid, c10d(coll) + user("train_step", line))


def idle_on_queue(pid: int, func: str = "next_batch", line: int = 20) -> Dump:
    return dump(
        pid,
        [
            fr("Condition.wait", f"{STDLIB}/threading.py", 327),
            fr("Queue.get", f"{STDLIB}/queue.py", 171),
        ]
        + user(func, line),
    )


def spinning(pid: int, line: int = 30, func: str = "compute_loss") -> Dump:
    return dump(pid, user(func, line), active=True)


def samples(*per_rank: list[Dump]) -> list[RankSamples]:
    return [RankSamples(rank=i, pid=ds[0].pid, dumps=list(ds)) for i, ds in enumerate(per_rank)]


def one(*dumps: Dump) -> list[RankSamples]:
    return samples(*[[d] for d in dumps])


# --------------------------------------------------------------------------- verdict kinds


def test_mismatched_collective_names_the_rank_that_never_joined():
    a = analyze(
        one(waiting(100), waiting(101), idle_on_queue(102, "wait_for_signal", 12)), [0, 1, 2]
    )
    v = a.verdict
    assert v.kind == "mismatched_collective"
    assert v.odd_ranks == [2]
    assert "train.py:10" in v.summary and "wait_for_signal" in v.summary
    assert [g.ranks for g in a.groups] == [[0, 1], [2]]


def test_collective_type_mismatch_odd_ranks_are_outside_the_largest_group():
    a = analyze(one(waiting(1, "all_reduce"), waiting(2, "all_reduce"), waiting(3, "recv", 3000)))
    assert a.verdict.kind == "collective_type_mismatch"
    assert a.verdict.odd_ranks == [2]
    assert {r.collective for r in a.ranks} == {"all_reduce", "send/recv"}


def test_collective_type_mismatch_tie_names_no_rank_and_lists_the_candidates():
    # Two against two: nothing says which side took the wrong branch; naming one would be a
    # guess given with the confidence of the samples.
    a = analyze(one(waiting(1, "all_reduce"), waiting(2, "all_reduce"), waiting(3, "barrier"),
                    waiting(4, "barrier")))  # fmt: skip
    assert a.verdict.kind == "collective_type_mismatch"
    assert a.verdict.odd_ranks == [] and a.verdict.candidates == [0, 1, 2, 3]
    assert "equal size" in a.verdict.summary
    assert a.verdict.to_json()["candidates"] == [0, 1, 2, 3]


def test_missing_rank_from_world_size():
    init = dump(
        7,
        [
            fr("_store_based_barrier", f"{SITE}/torch/distributed/distributed_c10d.py", 800),
            fr("init_process_group", f"{SITE}/torch/distributed/distributed_c10d.py", 1700),
        ]
        + user("setup", 5),
    )
    a = analyze(one(init), expected_ranks=[0, 1])
    v = a.verdict
    assert v.kind == "missing_rank"
    assert v.missing_ranks == [1] and v.odd_ranks == [1]
    assert a.ranks[0].collective == "init_process_group"
    assert a.ranks[1].state == "missing"


def test_rank_whose_process_vanished_during_dumping_counts_as_missing():
    gone = Dump(pid=9, error="Failed to open process", error_kind="gone")
    a = analyze(one(waiting(8), gone))
    assert a.verdict.kind == "missing_rank"
    assert a.verdict.missing_ranks == [1]


def test_blocked_outside_collective():
    a = analyze(one(idle_on_queue(1), idle_on_queue(2)))
    assert a.verdict.kind == "blocked_outside_collective"
    assert a.verdict.odd_ranks == []
    assert "next_batch" in a.verdict.summary
    assert len(a.groups) == 1 and a.groups[0].ranks == [0, 1]


def test_straggler_single_sample_asks_for_samples():
    a = analyze(one(waiting(1), spinning(2)))
    assert a.verdict.kind == "straggler"
    assert a.verdict.odd_ranks == [1]
    assert "--samples" in a.verdict.summary


def test_straggler_stuck_versus_slow_from_samples():
    # Stuck: spinning in one loop, only the line moves.
    stuck = analyze(samples([waiting(1)] * 3, [spinning(2, 30), spinning(2, 31), spinning(2, 30)]))
    assert stuck.verdict.kind == "straggler"
    assert stuck.ranks[1].progress == "stuck"
    assert "stuck" in stuck.verdict.summary
    assert stuck.verdict.is_hang and stuck.verdict.confidence == "high"
    # Slow: the busy rank moves through different functions; the others wait for it, but the
    # job moves, so it is no hang (yet).
    slow = analyze(
        samples(
            [waiting(1)] * 3,
            [spinning(2, 30, "forward"), spinning(2, 40, "backward"), spinning(2, 50, "step")],
        )
    )
    assert slow.verdict.kind == "progressing"
    assert not slow.verdict.is_hang
    assert slow.verdict.odd_ranks == [1]
    assert slow.ranks[1].progress == "slow"
    assert "slow, not stuck" in slow.verdict.summary


def test_no_hang_when_everybody_computes():
    a = analyze(one(spinning(1), spinning(2)))
    assert a.verdict.kind == "no_hang"
    assert a.verdict.odd_ranks == []


def test_no_hang_when_every_stack_moves_between_samples():
    a = analyze(
        samples(
            [waiting(1, line=10), waiting(1, line=11)], [waiting(2, line=10), waiting(2, line=12)]
        )
    )
    assert a.verdict.kind == "no_hang"


def ran(d: Dump, times: int) -> Dump:
    """The same dump as a later sample, its main thread scheduled in `times` times since."""
    return replace(d, ran={d.pid: times})


def test_a_thread_woken_between_samples_finished_collectives_so_the_job_moves():
    # A healthy loop of all_reduce: every sample finds the ranks at the same line of the same
    # collective, but their threads were woken hundreds of times in between.
    healthy = analyze(
        samples(
            [waiting(1), ran(waiting(1), 700), ran(waiting(1), 650)],
            [waiting(2), ran(waiting(2), 720), ran(waiting(2), 690)],
        )
    )
    assert healthy.verdict.kind == "no_hang"
    assert healthy.verdict.confidence == "high"
    assert [r.wakeups for r in healthy.ranks] == [1350, 1410]
    assert {r.progress for r in healthy.ranks} == {"moving"}


def test_nothing_moved_across_samples_is_a_hang_with_high_confidence():
    hung = analyze(
        samples(
            [waiting(1), ran(waiting(1), 0), ran(waiting(1), 0)],
            [idle_on_queue(2), ran(idle_on_queue(2), 0), ran(idle_on_queue(2), 0)],
        )
    )
    v = hung.verdict
    assert v.kind == "mismatched_collective" and v.is_hang
    assert v.confidence == "high"
    assert "nothing moved across 3 samples" in v.certainty
    assert "ranks 0-1 did not even run" in v.certainty
    assert v.to_json()["hang"] is True


def test_a_lone_wake_up_or_a_polling_sleeper_is_not_progress():
    # One wake-up can be a signal; an idle thread woken by its own timeout polls in place.
    a = analyze(
        samples(
            [waiting(1), ran(waiting(1), 1)],
            [idle_on_queue(2), ran(idle_on_queue(2), 50)],
        )
    )
    assert a.verdict.kind == "mismatched_collective"
    assert {r.progress for r in a.ranks} == {"still"}


def test_one_sample_is_a_snapshot_with_low_confidence():
    v = analyze(one(waiting(1), waiting(2))).verdict
    assert v.kind == "collective_stuck" and v.confidence == "low"
    assert "one sample" in v.certainty and "--samples" in v.certainty


def test_some_ranks_move_while_others_wait_is_progressing():
    a = analyze(
        samples(
            [waiting(1), ran(waiting(1), 0)],
            [idle_on_queue(2, "load", 5), ran(idle_on_queue(2, "parse", 6), 0)],
        )
    )
    assert a.verdict.kind == "progressing"
    assert a.verdict.odd_ranks == [1]  # rank 0 waits in a collective for rank 1, which moves
    assert a.verdict.confidence == "high"


def test_ranks_that_all_compute_are_no_hang_whether_or_not_their_stacks_move():
    a = analyze(
        samples(
            [spinning(1, 30, "forward"), spinning(1, 40, "backward")],
            [spinning(2, 30), spinning(2, 31)],
        )
    )
    assert a.verdict.kind == "no_hang"
    assert [r.progress for r in a.ranks] == ["slow", "stuck"]


def test_a_rank_that_exits_between_samples_is_missing_and_says_so():
    gone = Dump(pid=9, error="the process exited", error_kind="gone")
    a = analyze(samples([waiting(8), ran(waiting(8), 0)], [waiting(9), gone]))
    assert a.verdict.kind == "missing_rank"
    assert a.ranks[1].error == "the process exited during the dump"
    assert a.verdict.confidence == "high"


def test_collective_stuck_when_all_wait_in_the_same_collective():
    a = analyze(one(waiting(1), waiting(2)))
    assert a.verdict.kind == "collective_stuck"
    assert "nccl-bisect" in a.verdict.hint
    multi = analyze(one(waiting(1), waiting(2)), multi_host=True)
    assert "other hosts" in multi.verdict.hint


def test_no_verdict_when_nothing_could_be_read():
    bad = Dump(pid=1, error="Permission denied", error_kind="permission")
    a = analyze(one(bad))
    assert a.verdict is None
    assert a.ranks[0].state == "error"


# --------------------------------------------------------------------------- frames


def test_outermost_torch_entry_point_names_the_collective():
    frames = tuple(
        parse_pyspy_json(
            json.dumps(
                [
                    {
                        "thread_id": 1,
                        "os_thread_id": 1,
                        "thread_name": "MainThread",
                        "active": False,
                        "owns_gil": False,
                        "frames": c10d("all_gather", 3900)
                        + c10d("all_gather_object", 3000)
                        + user("gather_metrics", 7),
                    }
                ]
            )
        )[0].frames
    )
    assert find_collective(frames) == ("all_gather", "all_gather_object")


def test_work_wait_is_read_from_the_source_line():
    f = Frame("train_step", USER, 12, "train.py", code="handle.wait()")
    assert find_collective((f,)) == ("work.wait", "wait")
    assert find_collective((Frame("train_step", USER, 12, "train.py", code="x = y + 1"),)) is None


def test_native_frames_name_the_collective_with_native():
    frames = (
        Frame("gloo::AllreduceOp::run()", "/lib/libgloo.so", 0, native=True),
        Frame("c10d::ProcessGroupGloo::allreduce(...)", "/lib/libtorch_cpu.so", 0, native=True),
        Frame("train_step", USER, 12, "train.py"),
    )
    assert find_collective(frames)[0] == "all_reduce"


def test_user_frame_skips_torch_stdlib_and_frozen_frames():
    frames = tuple(
        parse_pyspy_json(
            json.dumps(
                [
                    {
                        "thread_id": 1,
                        "os_thread_id": 1,
                        "thread_name": "MainThread",
                        "active": False,
                        "owns_gil": False,
                        "frames": c10d("barrier")
                        + [fr("helper", "/home/me/lib/utils.py", 4)]
                        + [fr("_run_code", "<frozen runpy>", 88)],
                    }
                ]
            )
        )[0].frames
    )
    assert user_frame(frames).where() == "utils.py:4"


def test_a_collective_in_another_thread_is_found_when_main_is_not_in_one():
    side = {
        "thread_id": 2,
        "os_thread_id": 555,
        "thread_name": "comm",
        "active": False,
        "owns_gil": False,
        "frames": c10d("broadcast") + user("comm_loop", 44),
    }
    d = dump(
        50,
        [fr("Event.wait", f"{STDLIB}/threading.py", 600)] + user("main", 3),
        extra_threads=[side],
    )
    a = analyze(one(d, waiting(51, "broadcast")))
    assert a.ranks[0].collective == "broadcast"
    assert a.ranks[0].thread == "comm"


@pytest.mark.parametrize(
    "name,expected",
    [
        ("reduce_scatter_tensor", "reduce_scatter"),
        ("all_gather_into_tensor", "all_gather"),
        ("broadcast_object_list", "broadcast"),
        ("isend", "send/recv"),
        ("monitored_barrier", "barrier"),
        ("new_group", "new_group"),
        ("all_to_all_single", "all_to_all"),
        # What FSDP2 waits in on torch 2.13.
        ("all_gather_single", "all_gather"),
        ("reduce_scatter_single", "reduce_scatter"),
    ],
)
def test_collective_names_are_normalized(name, expected):
    frames = tuple(
        Frame(f["name"], f["filename"], f["line"], f["short_filename"])
        for f in c10d(name) + user("f", 1)
    )
    assert find_collective(frames)[0] == expected


def test_functional_collectives_and_their_wait_are_collectives():
    funcol = f"{SITE}/torch/distributed/_functional_collectives.py"
    frames = (
        Frame("wait_tensor", funcol, 140, "torch/distributed/_functional_collectives.py"),
        Frame("AsyncCollectiveTensor.wait", funcol, 700),
        Frame("train_step", USER, 12, "train.py"),
    )
    assert find_collective(frames) == ("work.wait", "wait_tensor")
    gather = (Frame("all_gather_tensor", funcol, 200), Frame("step", USER, 3))
    assert find_collective(gather) == ("all_gather", "all_gather_tensor")
    # The same names outside torch.distributed's API modules are nobody's collective.
    other = (Frame("all_reduce", "/home/me/mylib/comm.py", 5), Frame("step", USER, 3))
    assert find_collective(other) is None


def test_an_fsdp2_forward_hang_waits_in_all_gather_single():
    fsdp = f"{SITE}/torch/distributed/fsdp/_fully_shard"
    stack = dump(
        1,
        c10d("all_gather_single", 4394)
        + [
            fr("DefaultAllGather.__call__", f"{fsdp}/_fsdp_collectives.py", 119),
            fr("foreach_all_gather", f"{fsdp}/_fsdp_collectives.py", 364),
            fr("FSDPParamGroup.unshard", f"{fsdp}/_fsdp_param_group.py", 407),
            fr("FSDPParamGroup.pre_forward", f"{fsdp}/_fsdp_param_group.py", 551),
            fr("Module._call_impl", f"{SITE}/torch/nn/modules/module.py", 1884),
        ]
        + user("train_step", 24),
    )
    a = analyze(one(stack, idle_on_queue(2, "stall", 10)))
    assert a.ranks[0].collective == "all_gather"
    assert a.ranks[0].op == "all_gather_single"
    assert a.verdict.kind == "mismatched_collective"


def test_to_json_has_the_documented_shape():
    a = analyze(one(waiting(100), idle_on_queue(101)))
    data = a.to_json()
    for r in data["ranks"]:
        assert {"rank", "pid", "state", "collective", "frame"} <= set(r)
    for g in data["groups"]:
        assert {"ranks", "collective", "frame"} <= set(g)
    assert {
        "kind",
        "hang",
        "confidence",
        "certainty",
        "odd_ranks",
        "missing_ranks",
        "summary",
    } <= set(data["verdict"])
    assert {"progress", "wakeups"} <= set(data["ranks"][0])
    assert data["ranks"][0]["frame"]["line"] == 10


def test_our_example_scripts_are_the_users_code_wherever_they_are_installed():
    from areal_cli.diagnose.verdict import is_user_frame, user_frame

    lib = "/venv/lib/python3.11/site-packages"
    for root in (lib, "/work/checkout/src"):  # a wheel, the checkout's compat install
        repro = Frame("skip_collective", f"{root}/areal_cli/templates/allreduce_repro.py", 40)
        ours = Frame("wait", f"{root}/areal_cli/worker/runtime.py", 9)
        assert is_user_frame(repro) and not is_user_frame(ours)
        torch = Frame("all_reduce", f"{lib}/torch/distributed/distributed_c10d.py", 2800)
        assert user_frame((torch, ours, repro)) == repro
    from areal_cli.diagnose.why import user_frame as why_frame

    got = why_frame([(f"{lib}/areal_cli/templates/grpo/train.py", 88, "main"),
                     (f"{lib}/torch/nn/modules/module.py", 1700, "_call_impl")])  # fmt: skip
    assert got == (f"{lib}/areal_cli/templates/grpo/train.py", 88, "main")
