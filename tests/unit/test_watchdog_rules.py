"""The watchdog's rules, on their own: when a stall fires, and what counts as a rank moving."""

from __future__ import annotations

from areal_cli.diagnose.watchdog import Stall, StallClock, moved


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
