"""Following a trial's logs across runs: a new run's log is never mistaken for the old one,
even where the filesystem gives it the old one's inode."""

from __future__ import annotations

import os

from areal_cli import logfiles


def _run(path, lines: list[str]) -> None:
    """One run of a job writing its log as fresh_log makes it (unlink, then create)."""
    fd = logfiles.fresh_log(path)
    os.write(fd, "".join(f"{x}\n" for x in lines).encode())
    os.close(fd)


def _lines(follower) -> list[str]:
    return [line for _, line in follower.poll()]


def test_a_new_run_replacing_a_log_before_the_first_poll_loses_nothing(tmp_path):
    log = tmp_path / "rank-0.log"
    new = [f"new run line {i}" for i in range(20)]
    for _ in range(5):  # the old code lost lines whenever ext4 reused the inode: every time
        _run(log, ["old run line"] * 3)
        f = logfiles.Follower(tmp_path, history=None)
        f.skip_existing()
        _run(log, new)
        assert _lines(f) == new
        f.close()


def test_a_log_replaced_between_two_polls_is_read_from_its_start(tmp_path):
    log = tmp_path / "rank-0.log"
    for _ in range(5):
        _run(log, ["old run line"] * 3)
        f = logfiles.Follower(tmp_path, history=None)
        f.skip_existing()
        assert _lines(f) == []  # the old run's lines are not shown
        new = [f"the next run's line {i}" for i in range(10)]
        _run(log, new)  # longer than the old log by the next poll
        assert _lines(f) == new
        with open(log, "a") as w:
            w.write("more\n")
        assert _lines(f) == ["more"]
        f.close()


def test_the_same_file_growing_is_followed_from_where_it_was(tmp_path):
    log = tmp_path / "rank-0.log"
    _run(log, ["before"])
    f = logfiles.Follower(tmp_path, history=None)
    f.skip_existing()
    with open(log, "a") as w:
        w.write("after\npartial")
    assert _lines(f) == ["after"]
    with open(log, "a") as w:
        w.write(" line\n")
    assert _lines(f) == ["partial line"]
    f.close()
    assert f._held == {}


# -- `areal logs` of one job (every scheduler's log_iter) ----------------------------------------


def test_job_lines_shows_history_then_follows_until_the_job_ends(tmp_path):
    import pytest

    from areal_cli.errors import UsageError

    with pytest.raises(UsageError, match="no log files for e/t"):
        list(logfiles.job_lines("e/t", tmp_path, None, None, follow=False, lines=5,
                                live=lambda: True))  # fmt: skip
    log = tmp_path / "server-0.log"
    asked = []

    def live() -> bool:
        # A job still starting has no files yet; it writes one, then a last line as it ends.
        asked.append(1)
        if len(asked) == 2:
            _run(log, ["first", "second"])
        if len(asked) == 3:
            with open(log, "a") as f:
                f.write("last words\n")
            return False
        return True

    got = list(logfiles.job_lines("e/t", tmp_path, None, None, follow=True, lines=5, live=live))
    assert got == [("server-0", "first"), ("server-0", "second"), ("server-0", "last words")]
    # Not following: the last `lines` of each file, and no question whether the job lives.
    got = list(logfiles.job_lines("e/t", tmp_path, "server", 0, follow=False, lines=2,
                                  live=lambda: 1 / 0))  # fmt: skip
    assert [x for _, x in got] == ["second", "last words"]
