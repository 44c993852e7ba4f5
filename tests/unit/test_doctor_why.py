"""`areal doctor why`: the root cause of a job that died, from recorded logs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from areal_cli import schedulers
from areal_cli.diagnose import why
from areal_cli.schedulers.api import Scheduler
from tests.helpers import REPO, areal

LOGS = REPO / "tests" / "fixtures" / "logs"


def report(*names: str, kernel: why.Kernel | None = None) -> why.Report:
    return why.analyze(why.parse_files([(n, LOGS / n) for n in names]), kernel)


def test_areal_752_root_is_the_value_error_at_rl_py_413():
    rep = report("areal-752.log")
    root = rep.root
    assert root.kind == "python_exception"
    assert root.message == "ValueError: Invalid backend: None, expected sglang or vllm"
    assert root.where.endswith("areal/experimental/trainer/rl.py:413")
    assert root.ranks == [0, 1]
    kinds = {e.kind for e in rep.secondary}
    assert {"child_failed", "launcher_failed", "teardown_warning"} <= kinds
    # Every other line that tells of a failure is secondary, each naming its cause.
    assert all(e.caused_by for e in rep.secondary)
    child = next(e for e in rep.secondary if e.kind == "child_failed")
    assert "rl.py:413" in child.caused_by and child.where is None
    out = rep.to_json()
    assert set(out["root_cause"]) >= {"rank", "source", "kind", "message", "where"}


def test_a_peer_that_lost_its_connection_is_secondary():
    # Real torch 2.13 output: rank 1 raised; rank 0's all_reduce then saw the socket close,
    # and its traceback comes later in the log than nothing but torchrun's report.
    rep = report("torchrun-peer-closed.log")
    assert (rep.root.rank, rep.root.kind) == (1, "python_exception")
    assert rep.root.where == "/home/me/job/raise.py:7"
    lost = next(e for e in rep.secondary if e.kind == "connection_lost")
    assert lost.rank == 0 and "Connection closed by peer" in lost.message
    assert lost.caused_by.startswith("rank 1: python_exception")


def test_a_collective_size_mismatch_aborts_the_rank():
    rep = report("torchrun-mismatch.log")
    assert (rep.root.rank, rep.root.kind) == (0, "collective_mismatch")
    assert "Received data size doesn't match" in rep.root.message
    assert any(e.kind == "connection_lost" and e.rank == 1 for e in rep.secondary)


@pytest.mark.parametrize("op", ["all_gather_into_tensor", "reduce", "all_to_all"])
def test_size_mismatches_of_other_collectives_abort_a_rank_too(op):
    rep = report(f"torchrun-mismatch-{op}.log")
    assert rep.root.kind == "collective_mismatch", op
    assert "Received data size doesn't match" in rep.root.message


def test_cuda_oom_names_the_users_line_and_points_to_doctor_memory():
    rep = report("cuda-oom.log")
    assert (rep.root.rank, rep.root.kind) == (1, "cuda_oom")
    assert rep.root.where == "/home/me/rl/train.py:71"  # not torch's or transformers' frame
    assert "areal doctor memory" in rep.root.hint
    (timeout,) = [e for e in rep.secondary if e.kind == "collective_timeout"]
    assert timeout.rank == 0 and "WorkNCCL(SeqNum=412" in timeout.message


def test_cpu_oom_from_memory_error_and_the_allocator():
    for last in (
        "MemoryError",
        "RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't "
        "allocate memory: you tried to allocate 34359738368 bytes. Error code 12 (Cannot "
        "allocate memory)",
    ):
        lines = ["Traceback (most recent call last):",
                 '  File "/home/me/train.py", line 9, in <module>',
                 "    x = torch.empty(1 << 35)", last]  # fmt: skip
        rep = why.analyze(why.parse_log("rank-0", lines, rank=0))
        assert (rep.root.kind, rep.root.where) == ("cpu_oom", "/home/me/train.py:9")
        assert "areal doctor memory" in rep.root.hint


def _sigkill_log(pid: int) -> list[str]:
    return [
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "=" * 60, "train.py FAILED", "-" * 60, "Failures:", "  <NO_OTHER_FAILURES>", "-" * 60,
        "Root Cause (first observed failure):", "[0]:", "  time      : 2026-12-01_21:47:37",
        "  host      : localhost", "  rank      : 1 (local_rank: 1)",
        f"  exitcode  : -9 (pid: {pid})", "  error_file: <N/A>",
        f"  traceback : Signal 9 (SIGKILL) received by PID {pid}", "=" * 60,
    ]  # fmt: skip


def test_a_sigkill_is_the_oom_killers_when_the_kernel_names_the_pid():
    kills = why.kernel_oom_kills((LOGS / "dmesg-oom.txt").read_text())
    assert list(kills) == [4242]
    lines = ["Traceback (most recent call last):", *_sigkill_log(4242)]
    kernel = why.Kernel(oom_kills=kills, dmesg_readable=True)
    rep = why.analyze(why.parse_log("torchrun", lines), kernel)
    assert (rep.root.rank, rep.root.kind) == (1, "oom_killer")
    assert "Killed process 4242" in rep.root.detail[0]
    assert "areal doctor memory" in rep.root.hint
    # No kernel record of it: a signal from someone else, the cgroup's count said.
    kernel = why.Kernel(dmesg_readable=True, cgroup_oom_kill=0, cgroup_file="memory.events")
    rep = why.analyze(why.parse_log("torchrun", lines), kernel)
    assert (rep.root.rank, rep.root.kind) == (1, "signal")
    assert "dmesg names no OOM kill" in rep.root.sender


def test_slurm_counts_the_oom_kill_of_a_rank_on_another_node():
    rep = report("slurm-oom.out", kernel=why.Kernel(dmesg_readable=True, host="login"))
    assert (rep.root.rank, rep.root.kind, rep.root.exit_code) == (1, "oom_killer", -9)
    assert "Detected 1 oom_kill event" in rep.root.detail[0]
    assert "areal doctor memory" in rep.root.hint
    assert any(e.kind == "connection_lost" and e.rank == 0 for e in rep.secondary)


def test_a_timeout_with_nothing_before_it_is_a_hang():
    lines = ["Traceback (most recent call last):",
             '  File "/home/me/train.py", line 5, in <module>',
             '  File "/v/site-packages/torch/distributed/distributed_c10d.py", line 3252, in all_reduce',
             "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
             "waiting 2000ms for recv operation to complete"]  # fmt: skip
    rep = why.analyze(why.parse_log("rank-0", lines, rank=0))
    assert (rep.root.kind, rep.root.where) == ("collective_timeout", "/home/me/train.py:5")
    assert "areal doctor hang" in rep.root.hint


def test_cgroup_counts_in_both_cgroup_versions():
    assert why.cgroup_oom_kills("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\n") == 2
    assert why.cgroup_oom_kills("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n") == 5
    assert why.cgroup_oom_kills("nothing\n") is None


def test_slurm_time_limit_names_who_stopped_the_job():
    rep = report("slurm-timelimit.out")
    assert (rep.root.kind, rep.root.sender) == ("signal", "Slurm time limit")


def test_how_slurm_ended_a_job_names_who_sent_the_signal():
    for state, message, sched, sender in [
        ("failed", "Slurm: TIMEOUT", "slurm", "Slurm time limit"),
        ("killed", None, "slurm", "Slurm preemption"),
        ("cancelled", "cancelled outside areal (scancel, or an administrator)", "slurm",
         "Slurm cancel (scancel)"),
        ("failed", "Slurm: NODE_FAIL", "slurm", "Slurm node failure"),
    ]:  # fmt: skip
        (ev,) = why.record_events(state, message, killed_by=_killed_by(sched))
        assert (ev.kind, ev.sender) == ("signal", sender), (state, message)
    (ev,) = why.record_events("failed", "Slurm: OUT_OF_MEMORY", killed_by=_killed_by("slurm"))
    assert ev.kind == "oom_killer" and "areal doctor memory" in ev.hint
    assert why.record_events("killed", None, killed_by=_killed_by("local")) == []


def _killed_by(name: str) -> str | None:
    # What the caller (areal doctor why) passes: the job's scheduler's own declaration.
    return schedulers.scheduler_class(name).killed_by


class _Reclaiming(Scheduler):
    """A scheduler of its own that kills jobs when it takes their nodes back."""

    killed_by = "the cluster reclaiming its nodes"


def test_who_kills_a_job_is_what_its_scheduler_declares(tmp_path, monkeypatch):
    from areal_cli import plugins
    from tests.plugins import dist

    # A scheduler installed as a distribution of its own (its entry point on sys.path).
    group = {plugins.SCHEDULERS: {"reclaim": f"{__name__}:_Reclaiming"}}
    monkeypatch.syspath_prepend(str(dist.make(tmp_path, "reclaim", group)))
    plugins.refresh()
    try:
        (ev,) = why.record_events("killed", None, killed_by=_killed_by("reclaim"))
        assert (ev.kind, ev.sender) == ("signal", "the cluster reclaiming its nodes")
        # A scheduler that declares no killer: the record alone names no sender.
        assert why.record_events("killed", None) == []
    finally:
        monkeypatch.undo()
        plugins.refresh()


def test_a_stop_from_areal_outranks_what_the_stopped_ranks_say():
    recs = why.record_events("stopped", "stopped by areal stop")
    lines = ["stopping: SIGTERM"]
    rep = why.analyze([*recs, *why.parse_log("torchrun", lines)])
    assert (rep.root.kind, rep.root.sender, rep.root.rank) == ("signal", "areal stop", None)
    assert [e.kind for e in rep.secondary] == ["signal"]


def test_a_job_the_watchdog_ended_is_a_hang_not_the_signals_of_its_teardown():
    recs = why.record_events("failed", "watchdog: mismatched_collective: rank 1 never joined")
    lines = ["stopping: SIGTERM", "torch.distributed.elastic.multiprocessing.api.SignalException"
             ": Process 12 got signal: 15"]  # fmt: skip
    rep = why.analyze([*recs, *why.parse_log("torchrun", lines)])
    assert (rep.root.kind, rep.root.source) == ("hang", "job record")
    assert rep.root.message == "mismatched_collective: rank 1 never joined"
    assert "watchdog" in rep.root.sender and "--role watchdog" in rep.root.hint


def test_a_server_that_died_is_the_root_of_the_ranks_lost_connections():
    recs = why.record_events("failed", "rank-0 failed", [("server-0", -9), ("server-1", 0)])
    lines = ["Traceback (most recent call last):",
             '  File "/home/me/train.py", line 3, in <module>',
             "ConnectionRefusedError: [Errno 111] Connection refused"]  # fmt: skip
    rep = why.analyze([*recs, *why.parse_log("rank-0", lines, rank=0)])
    assert (rep.root.kind, rep.root.source) == ("server_died", "server-0")
    assert rep.secondary[0].kind == "connection_lost"


def test_a_servers_traceback_is_not_the_root_while_the_server_lived(tmp_path):
    tb = ["Traceback (most recent call last):", '  File "/srv/app.py", line 9, in handle']
    (tmp_path / "server-0.log").write_text("\n".join([*tb, "KeyError: 'prompt'"]) + "\n")
    (tmp_path / "rank-0.log").write_text("\n".join(
        ["Traceback (most recent call last):", '  File "/home/me/train.py", line 4, in <module>',
         "ValueError: reward is nan"]) + "\n")  # fmt: skip
    rep = why.diagnose_dir(tmp_path)
    assert (rep.root.kind, rep.root.rank) == ("python_exception", 0)
    assert [e.kind for e in rep.secondary] == ["server_error"]
    # A training job's verdict reads its own logs only: the servers' are the serving job's.
    rep = why.diagnose_dir(tmp_path, kind="train")
    assert rep.secondary == [] and rep.sources == [str(tmp_path / "rank-0.log")]
    # Nothing but the server's traceback: that is where to look.
    (tmp_path / "rank-0.log").write_text("step 1\n")
    assert why.diagnose_dir(tmp_path).root.kind == "server_error"


def test_timestamps_order_failures_across_logs():
    a = ["2026-12-01 10:00:05,000 INFO step", "Traceback (most recent call last):",
         '  File "/a.py", line 1, in <module>', "KeyError: 'x'"]  # fmt: skip
    b = ["2026-12-01 10:00:01,000 INFO step", "Traceback (most recent call last):",
         '  File "/b.py", line 2, in <module>', "TypeError: no"]  # fmt: skip
    events = why.parse_log("rank-0", a, rank=0) + why.parse_log("rank-1", b, rank=1)
    for i, e in enumerate(events):
        e.order = (i,)
    rep = why.analyze(events)
    assert (rep.root.rank, rep.root.where) == (1, "/b.py:2")


def test_cli_log_mode_json_and_text(tmp_path):
    res = areal("doctor", "why", "--log", str(LOGS / "areal-752.log"), "--json", check=0)
    out = json.loads(res.stdout)
    assert out["root_cause"]["kind"] == "python_exception"
    assert out["root_cause"]["where"].endswith("rl.py:413")
    assert out["secondary"] and all("caused_by" in e for e in out["secondary"])
    text = areal("doctor", "why", "--log", str(LOGS / "cuda-oom.log"), check=0).stdout
    assert "root cause: rank 1 · cuda_oom" in text and "areal doctor memory" in text
    quiet = Path(tmp_path / "ok.log")
    quiet.write_text("step 1\nstep 2\n")
    assert "no failure found" in areal("doctor", "why", "--log", str(quiet), check=1).stdout


def test_cli_bad_input_is_one_message_and_exit_2(tmp_path):
    for args in (["--log", str(tmp_path / "missing.log")], [], ["a/b/c"], ["nojob/here"]):
        res = areal("doctor", "why", *args, env={"AREAL_HOME": str(tmp_path)}, check=2)
        assert "error:" in res.stderr and "Traceback" not in res.stderr


# -- logs as they come from the field (issue #24): classes of misses, each a general rule ------

# Rank 1's traceback of AReaL issue #752, as torch wrote it, without any prefix.
_TB = (LOGS / "areal-752.log").read_text().splitlines()[5:17]
_TB = [line.removeprefix("[rank1]: ").removeprefix("[rank1]:") for line in _TB]


def _dress(how: str) -> list[str]:
    """The same traceback as launchers, loggers and pastes hand it over."""
    if how == "timestamp before [rankN]:":
        return [f"2025-12-19T09:39:34.790123Z [rank1]: {x}" for x in _TB]
    if how == "vLLM worker":
        return [f"(VllmWorker rank=1 pid=4242) ERROR 12-19 09:39:34 [executor.py:487] {x}"
                for x in _TB]  # fmt: skip
    if how == "Ray actor":
        return [f"\x1b[36m(TrainActor pid=4242, ip=10.0.0.2)\x1b[0m {x}" for x in _TB]
    if how == "SGLang mid-line":
        return [f"[2025-12-19 09:39:34 TP1] Scheduler hit an exception: {_TB[0]}", *_TB[1:]]
    if how == "quoted reply":
        return ["> " + x for x in _TB]
    if how == "indentation lost":
        return [x.strip() for x in _TB]
    if how == "abridged":
        return [*_TB[:2], "[...]", *_TB[5:]]
    if how == "Markdown fence":
        return ["```", *_TB, "```"]
    raise AssertionError(how)


@pytest.mark.parametrize(
    "how",
    [
        "timestamp before [rankN]:",
        "vLLM worker",
        "Ray actor",
        "SGLang mid-line",
        "quoted reply",
        "indentation lost",
        "abridged",
        "Markdown fence",
    ],
)
def test_a_traceback_is_read_through_prefixes_and_pastes(how):
    rep = why.analyze(why.parse_log("pasted.log", _dress(how)))
    assert rep.root.kind == "python_exception", how
    assert rep.root.message == "ValueError: Invalid backend: None, expected sglang or vllm", how
    assert rep.root.where.endswith("areal/experimental/trainer/rl.py:413"), how
    if how in ("timestamp before [rankN]:", "vLLM worker", "SGLang mid-line"):
        assert rep.root.rank == 1, how  # the prefix (or SGLang's TP1) names the rank


_TIMEOUT = (
    "[rank{r}]:[E1206 18:44:12.715298746 ProcessGroupNCCL.cpp:607] [Rank {r}] Watchdog caught "
    "collective operation timeout: WorkNCCL(SeqNum=7753, OpType=ALLREDUCE, NumelIn=5, "
    "NumelOut=5, Timeout(ms)=600000) ran for 600061 milliseconds before timing out."
)


@pytest.mark.parametrize(
    "first, kind",
    [
        ("[rank5]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 58.15 GiB. "
         "GPU 5 has a total capacity of 79.1 GiB of which 1.2 GiB is free.", "cuda_oom"),
        ("[12345.678] Out of memory: Killed process 4242 (python) total-vm:53312244kB, "
         "anon-rss:31451456kB, file-rss:74816kB, shmem-rss:12296kB, UID:0", "oom_killer"),
        ("(raylet) node_manager.cc:3277: 1 Workers (tasks / actors) killed due to memory "
         "pressure (OOM), 0 Workers crashed due to other reasons at node", "oom_killer"),
    ],
)  # fmt: skip
def test_order_over_volume_one_oom_among_fifty_timeouts(first, kind):
    # Fifty ranks' timeouts printed first, then the one line that caused them.
    lines = [_TIMEOUT.format(r=r) for r in range(50) if r != 5] + [first]
    lines += [_TIMEOUT.format(r=r) for r in range(50, 64)]
    rep = why.analyze(why.parse_log("job.log", lines))
    assert rep.root.kind == kind
    assert all(e.kind == "collective_timeout" for e in rep.secondary)
    assert rep.advice["action"] == ("stop" if kind == "cuda_oom" else "restart")


@pytest.mark.parametrize(
    "line, rank, named",
    [
        ("ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: -9) "
         "local_rank: 3 (pid: 407727) of binary: /usr/bin/python", 3, "SIGKILL"),
        ("E0323 21:57:08.583000 23 torch/distributed/elastic/multiprocessing/api.py:869] "
         "failed (exitcode: -11) local_rank: 1 (pid: 88) of binary: /opt/venv/bin/python3",
         1, "SIGSEGV"),
        ("[2024-02-09 09:09:15,164] torch.distributed.elastic.multiprocessing.api: [ERROR] "
         "failed (exitcode: -6) local_rank: 0 (pid: 170581) of binary: /usr/bin/python3", 0,
         "SIGABRT"),
        ("[2023-04-14 13:11:27,885] [ERROR] [launch.py:434:sigkill_handler] ['/usr/bin/python3',"
         " '-u', 'main.py', '--local_rank=2'] exits with return code = -9", 2, "SIGKILL"),
        ("srun: error: node-7: task 6: Killed", 6, "SIGKILL"),
        ("subprocess.CalledProcessError: Command '['/usr/bin/python3', '-u', 'train.py', "
         "'--local_rank=7']' died with <Signals.SIGSEGV: 11>.", 7, "SIGSEGV"),
        ("srun: error: node-7: task 2: Exited with exit code 3", 2, "exit code 3"),
    ],
)  # fmt: skip
def test_a_launchers_one_line_report_names_the_rank_and_the_signal(line, rank, named):
    rep = why.analyze(why.parse_log("launcher.log", ["step 12", line]))
    assert rep.root.rank == rank
    assert named in rep.root.message
    want = {"SIGABRT": "native_abort", "exit code 3": "exit_code"}.get(named, "signal")
    assert rep.root.kind == want


def test_a_launchers_traceback_is_never_the_root():
    # torchrun's own traceback, cut by the paste before its ChildFailedError: the messenger.
    lines = (REPO / "tests" / "fixtures" / "why" / "minicpm-v-770.log").read_text().splitlines()
    rep = why.analyze(why.parse_log("x.log", lines))
    assert (rep.root.kind, rep.root.rank, rep.root.where) == ("signal", 0, None)
    assert "SIGKILL" in rep.root.message
    assert {e.kind for e in rep.secondary} == {"child_failed"}  # its line and its traceback


def test_advice_is_in_the_report_the_json_and_the_text():
    assert why_advice("python_exception")["action"] == "stop"
    assert why_advice("collective_timeout")["action"] == "restart"
    assert why_advice("signal", sender="areal stop")["action"] == "stop"
    assert why_advice("signal", sender="Slurm preemption")["action"] == "restart"
    assert why_advice("signal", exit_code=-9)["action"] == "unknown"
    assert "SIGKILL" in why_advice("signal", exit_code=-9)["reason"]
    log = str(LOGS / "areal-752.log")
    out = json.loads(areal("doctor", "why", "--log", log, "--json", check=0).stdout)
    assert out["advice"]["action"] == out["root_cause"]["advice"]["action"] == "stop"
    assert out["advice"]["reason"]
    text = areal("doctor", "why", "--log", log, check=0).stdout
    assert "advice: stop · a Python exception" in " ".join(text.split())


def why_advice(kind, **kw):
    from areal_cli.diagnose.why_kinds import advice

    return advice(kind, **kw)


def test_only_consequences_name_candidates_not_a_rank():
    lines = [_TIMEOUT.format(r=r) for r in (3, 0, 1)]
    rep = why.analyze(why.parse_log("job.log", lines))
    assert rep.root.kind == "collective_timeout" and rep.root.rank is None
    assert rep.candidates == [0, 1, 3] and "consequences" in rep.unsure
    root = rep.to_json()["root_cause"]
    assert root["rank"] is None and root["candidates"] == [0, 1, 3]


def test_help_lists_every_kind_of_the_table():
    from areal_cli.diagnose.why_kinds import KINDS

    text = areal("doctor", "why", "--help", env={"COLUMNS": "120"}, check=0).stdout
    for k in KINDS:  # one line each: the kind, then its advice
        assert re.search(rf"^\s*{k.name}\s+{k.advice}\s", text, re.M), k.name


def test_a_sigkill_on_another_host_is_not_judged_by_this_hosts_kernel_log():
    lines = (REPO / "tests" / "fixtures" / "why" / "cppo-6.log").read_text().splitlines()
    here = why.Kernel(oom_kills={14750: "Out of memory: Killed process 14750 (python)"},
                      dmesg_readable=True, host="this-node")  # fmt: skip
    rep = why.analyze(why.parse_log("x.log", lines), here)
    assert (rep.root.kind, rep.root.rank) == ("signal", 0)  # the same pid here proves nothing
    assert "mlxlab115rp2n7682d40d9" in rep.root.sender and "not read here" in rep.root.sender


def test_a_traceback_cut_by_the_teardown_does_not_outrank_what_killed_its_peer():
    # Rank 1 was killed; torchrun's SIGTERM cut rank 0 while it printed its traceback.
    lines = [
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "/home/me/job/train.py", line 40, in <module>',
        "[rank0]:     dist.all_reduce(load_batch(step))",
        "W1219 09:39:36.303000 2211 torch/distributed/elastic/multiprocessing/api.py:908] "
        "Sending process 2285 closing signal SIGTERM",
        "E1219 09:39:36.468000 2211 torch/distributed/elastic/multiprocessing/api.py:882] "
        "failed (exitcode: -9) local_rank: 1 (pid: 2286) of binary: /usr/bin/python3",
    ]
    rep = why.analyze(why.parse_log("torchrun.log", lines))
    assert (rep.root.kind, rep.root.rank, rep.root.exit_code) == ("signal", 1, -9)
    cut = next(e for e in rep.secondary if e.rank == 0)
    assert cut.cut and "traceback is cut" in cut.message and cut.where == "/home/me/job/train.py:40"


def test_srun_tasks_of_a_torchrun_per_node_are_not_ranks():
    # `areal train --scheduler slurm` on two nodes, rank 1 (node 2's local rank 0) SIGKILLed:
    # srun then ends the step, killing node 1's torchrun (its task 0). Task 0 is a launcher,
    # not rank 0: the root is the rank torchrun names, not the step's teardown.
    srun = ["srun: error: n2: task 1: Exited with exit code 1",
            "srun: launch/slurm: _step_signal: Terminating StepId=23.0",
            "slurmstepd-n1: error: *** STEP 23.0 ON n1 CANCELLED AT 2026-12-05T11:31:00 ***",
            "srun: error: n1: task 0: Killed"]  # fmt: skip
    torchrun = ["E1205 11:30:57.894000 9078 torch/distributed/elastic/multiprocessing/api.py"
                ":1002] failed (exitcode: -9) local_rank: 0 (pid: 9260) of binary: /bin/python3",
                "Root Cause (first observed failure):", "[0]:",
                "  time      : 2026-12-05_11:30:57", "  host      : localhost",
                "  rank      : 1 (local_rank: 0)", "  exitcode  : -9 (pid: 9260)  (SIGKILL)",
                "  error_file: <N/A>",
                "  traceback : Signal 9 (SIGKILL) received by PID 9260"]  # fmt: skip
    rep = why.analyze(why.parse_log("supervisor-train.log", srun)
                      + why.parse_log("torchrun-n2.log", torchrun))  # fmt: skip
    assert (rep.root.kind, rep.root.rank) == ("signal", 1), rep.root
    assert "SIGKILL" in rep.root.message and "pid 9260" in rep.root.message
    # Where srun started the ranks itself (no per-node launcher's report), a task is a rank:
    # the first task that failed.
    alone = why.analyze(why.parse_log("launcher.log", srun))
    assert (alone.root.kind, alone.root.rank) == ("exit_code", 1), alone.root
