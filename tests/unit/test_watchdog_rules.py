"""The watchdog's rules, on their own: when a stall fires, and what counts as a rank moving."""

from __future__ import annotations

import time

from areal_cli.diagnose import watchdog
from areal_cli.diagnose.watchdog import Stall, StallClock, auto_limit, moved, step_median
from areal_cli.worker import channel


def test_a_stall_fires_once_after_the_seconds_and_again_only_after_progress():
    c = StallClock(10, now=0)
    assert not c.update(False, 9.9)
    assert c.update(False, 10.0)
    assert not any(c.update(False, t) for t in (11, 30, 300))  # once per stall, not a storm
    assert not c.update(True, 301)  # progress resumed
    assert not c.update(False, 310.9)
    assert c.update(False, 311.0)


def test_progress_resets_the_clock_at_any_rank():
    c = StallClock(5, now=0)
    for t in range(1, 40):
        assert not c.update(t % 4 == 0, float(t))  # some rank moves every 4 s < 5 s


def test_what_moving_means():
    assert moved(None, ("movement", 0, 0))  # the first look: it runs
    assert not moved(None, ("gone",))
    assert moved(("reports", 3), ("reports", 4))
    assert not moved(("reports", 4), ("reports", 4))
    assert moved(("movement", 10, 5), ("reports", 1))  # began to report
    assert moved(("movement", 10, 5), ("movement", 11, 5))  # ran
    assert moved(("movement", 10, 5), ("movement", 10, 7))  # woken twice
    assert not moved(("movement", 10, 5), ("movement", 10, 6))  # one wake-up is no progress
    assert not moved(("movement", 10, 5), ("gone",))


def test_headline_leads_with_the_kind_and_the_odd_ranks():
    s = Stall(at=0, idle_s=3, kind="wrong_group", odd_ranks=[1, 3], summary="x", bundle=None)
    assert s.headline() == "wrong_group (odd ranks 1,3): x"


def test_auto_is_10x_the_median_step_between_the_floor_and_the_fixed_value():
    assert auto_limit(None, 300) == watchdog.Limit(300, auto=True)  # no step timed yet
    assert auto_limit(None, 300).why() == "auto: fixed until 5 steps are timed"
    steps = auto_limit(4.1, 300)
    assert steps.seconds == 41 and steps.why() == "auto: 10x the median step 4.1s"
    fast = auto_limit(0.3, 300)
    assert fast.seconds == 20
    assert fast.why() == "auto: 10x the median step 0.3s, raised to the 20s floor"
    slow = auto_limit(45, 300)
    assert slow.seconds == 300 and slow.why() == "auto: 10x the median step 45s, capped at 300s"
    assert auto_limit(0.3, 10).seconds == 10  # a floor above the fixed value: the fixed value
    assert watchdog.Limit(3).why() == ""  # --watchdog SECONDS: said as before


def test_the_median_is_the_slowest_ranks_and_needs_enough_steps():
    looks = {
        1: ("reports", 9, [0.3, 0.3, 0.31, 9.0, 0.29]),  # one slow step: the median holds
        2: ("reports", 9, [0.4, 0.41, 0.4, 0.42, 0.4, 0.39]),
        3: ("reports", 2, [50.0]),  # too few steps timed
        4: ("movement", 5, 5),
        5: ("gone",),
        6: ("reports", 3),  # a rank of an older areal: no step times
    }
    assert step_median(looks) == 0.4
    assert step_median({3: looks[3], 4: looks[4]}) is None
    # No time below 0, infinite or not a number counts (a NaN limit would never fire).
    odd = {1: ("reports", 9, [float("nan"), -1.0, 0.3, 0.3, 0.3, 0.3])}
    assert step_median(odd) is None
    assert step_median({1: ("reports", 9, [float("inf")] * 5)}) is None


def test_a_rank_keeps_the_times_between_its_last_steps(monkeypatch):
    monkeypatch.setattr(channel, "PROGRESS", channel.Progress())
    channel.report_progress(0)
    assert channel._progress({})["intervals"] == []
    time.sleep(0.05)
    channel.report_progress(source="rollout")  # within a step: no step of its own
    channel.report_progress(1)
    got = channel._progress({})
    assert got["count"] == 3 and got["step"] == 1 and len(got["intervals"]) == 1
    assert got["intervals"][0] >= 0.05  # from step 0's report, across the rollout's
    for step in range(2, 2 + 2 * channel.STEP_TIMES):
        channel.report_progress(step)
    assert len(channel._progress({})["intervals"]) == channel.STEP_TIMES  # the last ones only
