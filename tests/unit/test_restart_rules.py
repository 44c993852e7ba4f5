"""The restart decision of `areal train --max-restarts` (diagnose.restart) as rules over the
doctor's root cause: each row on its own, from recorded log text and plain failures."""

from __future__ import annotations

import json

import pytest

from areal_cli.diagnose import restart, why, why_kinds


def _failure(kind, what="x", place=("p",)):
    return restart.Failure(kind, what, place, *why_kinds.restart_verdict(kind))


def test_every_kind_has_a_restart_answer_with_a_reason():
    for k in why_kinds.KINDS:
        ok, reason = why_kinds.restart_verdict(k.name)
        assert isinstance(ok, bool) and reason, k.name
        # Where the doctor's advice is decided, the restart column says the same.
        if k.advice != why_kinds.UNKNOWN:
            assert ok == (k.advice == why_kinds.RESTART) == k.restart, k.name


@pytest.mark.parametrize(
    "kind, restarts",
    [("signal", True), ("oom_killer", True), ("collective_timeout", True),
     ("connection_lost", True), ("server_died", True), ("process_died", True),
     ("python_exception", False), ("config_error", False), ("cuda_oom", False),
     ("collective_mismatch", False), ("exit_code", False)],
)  # fmt: skip
def test_infrastructure_faults_restart_and_bugs_stop(kind, restarts):
    assert why_kinds.restart_verdict(kind)[0] is restarts


def test_a_signal_sent_on_purpose_is_not_restarted():
    ok, reason = why_kinds.restart_verdict("signal", "areal stop", -15)
    assert not ok and "on purpose" in reason
    assert why_kinds.restart_verdict("signal", "Slurm node failure", -9)[0]
    assert not why_kinds.restart_verdict(None)[0]


def test_the_rules_in_order():
    infra, bug = _failure("signal", "rank 1 killed by SIGKILL"), _failure("python_exception")
    d = restart.decide(infra, 0, 3, "infra", None)
    assert d.restart and d.attempt == 1 and d.line.startswith("restart 1/3: rank 1 killed by "
                                                              "SIGKILL (signal): ")  # fmt: skip
    d = restart.decide(bug, 0, 3, "infra", None)
    assert not d.restart and d.line.startswith("not restarting: x (python_exception) would repeat")
    # --restart-on any: every failure, the same one too, until the budget is spent.
    assert restart.decide(bug, 1, 3, "any", bug).restart
    d = restart.decide(bug, 3, 3, "any", bug)
    assert not d.restart and d.line.startswith("not restarting: the 3 restarts are spent")
    # The same fault at the same place as the one before the last restart: it repeats.
    d = restart.decide(infra, 1, 3, "infra", infra)
    assert not d.restart and "again, at the same place as before restart 1" in d.line
    elsewhere = _failure("signal", "rank 1 killed by SIGKILL", place=("q",))
    assert restart.decide(elsewhere, 1, 3, "infra", infra).restart


def test_the_place_ignores_pids_and_ports_but_not_the_frame(tmp_path):
    def root(msg, where):
        ev = why.Event("connection_lost", msg, "rank-0", rank=0, where=where)
        return restart.from_report(why.Report(ev, []), tmp_path)

    a = root("RuntimeError: Connection closed by peer [127.0.0.1]:3997 (pid 12)", "t.py:9")
    b = root("RuntimeError: Connection closed by peer [127.0.0.1]:4486 (pid 40)", "t.py:9")
    c = root("RuntimeError: Connection closed by peer [127.0.0.1]:4486 (pid 40)", "t.py:12")
    assert a.place == b.place != c.place
    assert a.what == "rank 0 RuntimeError: Connection closed by peer [127.0.0.1]:3997 in t.py:9"


def test_a_frameless_failure_is_placed_by_its_ranks_last_line(tmp_path):
    ev = why.Event("signal", "rank 1 killed by SIGKILL (pid 7)", "torchrun", rank=1)
    (tmp_path / "rank-1.log").write_text("step 1\nstep 2\n")
    first = restart.from_report(why.Report(ev, []), tmp_path)
    assert first.what == "rank 1 killed by SIGKILL" and first.place[-1] == "step 2"
    (tmp_path / "rank-1.log").write_text("step 1\nstep 2\nstep 3\n")
    assert restart.from_report(why.Report(ev, []), tmp_path).place != first.place


def test_the_decision_log_round_trips(tmp_path):
    infra = _failure("signal", "rank 1 killed by SIGKILL", place=("signal", 1, "m", "step 2"))
    restart.append_log(tmp_path, restart.decide(infra, 0, 2, "infra", None))
    (tmp_path / restart.LOG).open("a").write('{"cut short')  # a full disk's last line
    log = restart.read_log(tmp_path)
    assert [d["attempt"] for d in log] == [1] and json.dumps(log)
    assert restart.previous_failure(log).place == infra.place
    assert restart.read_log(tmp_path / "none") == [] and restart.read_log(None) == []


def test_torchruns_local_rank_on_a_later_node_is_named_by_its_global_rank():
    # Node 2 of two, one rank each: torchrun's line says local_rank 0; its block, rank 1.
    lines = [
        "E1205 10:10:33.873000 8012 torch/distributed/elastic/multiprocessing/api.py:1002] "
        "failed (exitcode: -9) local_rank: 0 (pid: 26701) of binary: /usr/bin/python3",
        "Traceback (most recent call last):",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "=" * 60, "train.py FAILED", "-" * 60, "Failures:", "  <NO_OTHER_FAILURES>", "-" * 60,
        "Root Cause (first observed failure):", "[0]:", "  time      : 2026-12-05_10:10:33",
        "  host      : n2", "  rank      : 1 (local_rank: 0)",
        "  exitcode  : -9 (pid: 26701)", "  error_file: <N/A>",
        "  traceback : Signal 9 (SIGKILL) received by PID 26701", "=" * 60,
    ]  # fmt: skip
    kernel = why.Kernel(dmesg_readable=True, cgroup_oom_kill=0, cgroup_file="memory.events")
    rep = why.analyze(why.parse_log("torchrun-n2", lines), kernel)
    assert (rep.root.rank, rep.root.kind) == (1, "signal")


def _node_report(when: str, rank: int, code: int, pid: int) -> list[str]:
    """A node's torchrun: its one-line failure (local rank 0) and its failures block."""
    sig = "  (SIGKILL)" if code == -9 else " "
    return [
        f"E1205 {when}.296000 14613 torch/distributed/elastic/multiprocessing/api.py:1002] "
        f"failed (exitcode: {code}) local_rank: 0 (pid: {pid}) of binary: /usr/bin/python3",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "=" * 54, "restart_steps.py FAILED", "-" * 54, "Failures:", "  <NO_OTHER_FAILURES>",
        "-" * 54, "Root Cause (first observed failure):", "[0]:",
        f"  time      : 2026-12-05_{when}", "  host      : localhost",
        f"  rank      : {rank} (local_rank: 0)", f"  exitcode  : {code} (pid: {pid}){sig}",
        "  error_file: <N/A>", "=" * 54,
    ]  # fmt: skip


def test_a_node_stopped_after_anothers_rank_died_does_not_hide_which_died_first(tmp_path):
    # Rank 1 (node 2) SIGKILLed; rank 0 (node 1) lost its peer and exited 1 a second later;
    # then node 1's launcher was told to stop (srun --kill-on-bad-exit): rank 1 is the root.
    n1 = [*_node_report("10:56:53", 0, 1, 100), "stopping: SIGTERM"]
    n2 = _node_report("10:56:52", 1, -9, 200)
    kernel = why.Kernel(dmesg_readable=True, cgroup_oom_kill=0, cgroup_file="memory.events")
    events = why.parse_log("torchrun-n1", n1) + why.parse_log("torchrun-n2", n2)
    for k, e in enumerate(events):
        e.order = (0 if e.source == "torchrun-n1" else 1, e.line or 0, k)
    rep = why.analyze(events, kernel)
    assert (rep.root.rank, rep.root.kind) == (1, "signal"), rep.root
