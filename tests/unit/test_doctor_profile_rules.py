"""The profile summary's rules on speedscope data as py-spy writes it (no processes): the
collective share, compute between collectives, the straggler, the flame graph; and how a rank
arms the doctor's consistency check only for a step it has not reached."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from areal_cli.diagnose import profile
from areal_cli.worker import channel, consistency

C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
FRAMES = [
    {"name": "<module>", "file": "/job/train.py", "line": 1},
    {"name": "compute", "file": "/job/train.py", "line": 5},
    {"name": "sync_grads", "file": "/job/train.py", "line": 9},
    {"name": "all_reduce", "file": C10D, "line": 2800},
]
COMPUTE, COLLECTIVE = [0, 1], [0, 2, 3]


def speedscope(pattern: str) -> dict:
    """One sample per letter: c computes, a waits in all_reduce (10 ms each)."""
    samples = [COMPUTE if ch == "c" else COLLECTIVE for ch in pattern]
    return {
        "shared": {"frames": FRAMES},
        "profiles": [
            {"name": 'Thread 7 "Thread-1"', "samples": [[0]], "weights": [0.01]},
            {"name": 'Thread 1 "MainThread"', "type": "sampled", "samples": samples,
             "weights": [0.01] * len(samples)},
        ],
    }  # fmt: skip


def summary(rank: int, pattern: str) -> profile.RankProfile:
    r = profile.RankProfile(rank, 100 + rank)
    profile.summarise(r, speedscope(pattern), 100)
    return r


def test_the_rank_that_computes_longest_between_collectives_is_the_straggler():
    fast = "caa" * 20  # 10 ms compute, then waits 20 ms for the slow rank
    ranks = [summary(0, fast), summary(1, fast), summary(2, "ccca" * 15)]
    assert ranks[0].collective_share == round(40 / 60, 4) and ranks[0].samples == 60
    assert ranks[0].compute_between_s == 0.01 and ranks[2].compute_between_s == 0.03
    assert ranks[2].top_self[0]["function"].startswith("compute (job/train.py)")
    got = profile.straggler(ranks)
    assert got["rank"] == 2 and got["ratio"] == 3.0


def test_no_straggler_when_the_ranks_compute_alike_or_nobody_waits():
    assert profile.straggler([summary(0, "ca" * 30), summary(1, "ca" * 30)]) is None
    # Longer compute, but the others do not wait in collectives: no one waits for it.
    barely = summary(0, "ccccca" * 10)  # 17% in collectives
    assert barely.collective_share < profile.MIN_WAIT_SHARE
    assert profile.straggler([barely, summary(1, "c" * 59 + "a")]) is None


def test_the_flame_graph_is_svg_with_a_box_per_call_path():
    stacks, weights = profile.main_thread(speedscope("caa" * 3))
    root = ET.fromstring(profile.flamegraph_svg(stacks, weights, title="rank 0"))
    titles = [el.text for el in root.iter("{http://www.w3.org/2000/svg}title")]
    assert any(t.startswith("all_reduce (distributed/distributed_c10d.py): 66.7%") for t in titles)
    assert any(t.startswith("<module> (job/train.py): 100.0%") for t in titles)


def test_a_rank_arms_the_check_only_for_a_step_to_come():
    channel.report_progress(5)
    try:
        assert channel.HANDLERS["diverge_arm"]({"step": 5})["armed"] is False
        assert channel.HANDLERS["diverge_arm"]({"step": 7})["armed"] is True
        assert consistency.armed()
        assert channel.HANDLERS["diverge_result"]({"step": 7, "wait": 0})["done"] is False
        assert channel.HANDLERS["diverge_cancel"]({"step": 7}) == {"cancelled": True}
        assert not consistency.armed()
    finally:
        consistency._ARMED.clear()


def _main_thread_at(step: int):
    import threading

    t = threading.Thread(target=consistency.at_step, args=(step,), daemon=True)
    t.start()
    return t


def test_a_rank_at_an_armed_step_waits_for_the_decision_and_runs_only_on_commit():
    channel.report_progress(5)
    consistency.watch(object())
    try:
        # Cancelled while the rank waits at the step: it goes on without the check.
        assert channel.HANDLERS["diverge_arm"]({"step": 6})["armed"] is True
        waiting = _main_thread_at(6)
        waiting.join(0.3)
        assert waiting.is_alive()  # neither ran nor went past before the decision
        assert channel.HANDLERS["diverge_cancel"]({"step": 6}) == {"cancelled": True}
        waiting.join(5)
        assert not waiting.is_alive() and not consistency.armed()
        # Committed: the waiting rank runs the check (one process, no group: all agree).
        assert channel.HANDLERS["diverge_arm"]({"step": 7})["armed"] is True
        waiting = _main_thread_at(7)
        waiting.join(0.3)
        assert waiting.is_alive()
        assert channel.HANDLERS["diverge_commit"]({"step": 7})["committed"] is True
        got = channel.HANDLERS["diverge_result"]({"step": 7, "wait": 120})  # torch's import
        assert got["done"] is True and got["report"]["ok"] is True
        # A committed step cannot be cancelled any more (a rank may be inside the check).
        channel.HANDLERS["diverge_arm"]({"step": 9})
        channel.HANDLERS["diverge_commit"]({"step": 9})
        assert channel.HANDLERS["diverge_cancel"]({"step": 9}) == {"cancelled": False}
    finally:
        consistency._ARMED.clear()
        consistency._TARGETS.clear()
