"""The hang doctor where users actually run and where things go wrong around it: ranks in a
PID namespace of their own (a container, `unshare --pid`), a rank someone stopped, and a pid
that is no launcher at all (`--pid 1`). Real torchrun, real gloo, real py-spy."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from areal_cli import procs
from areal_cli.diagnose import stacks
from tests.integration.test_doctor_hang import AREAL, doctor, launch, stop_all, verdict_of


def _can_unshare_pid() -> bool:
    try:
        res = subprocess.run(
            ["unshare", "--pid", "--fork", "true"], capture_output=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return res.returncode == 0


@pytest.fixture(scope="module")
def in_namespace(tmp_path_factory):
    """skip_allreduce (rank 1 skips the all_reduce rank 0 waits in), its torchrun being pid 1
    of a PID namespace of its own."""
    if not _can_unshare_pid():
        pytest.skip("unshare --pid is not permitted here (needs root or user namespaces)")
    tmp = tmp_path_factory.mktemp("doctor-ns")
    s = launch("skip_allreduce", 2, tmp, wrap=["unshare", "--pid", "--fork"], label="ns")
    try:
        s.wait_ready()
        yield s
    finally:
        stop_all([s])


def _torchrun(s) -> int:
    """The namespace's init: torchrun, the child of `unshare`."""
    return psutil.Process(s.proc.pid).children()[0].pid


def _ranks(s) -> list[int]:
    """The ranks as this host's /proc names them."""
    return sorted(c.pid for c in psutil.Process(_torchrun(s)).children())


def test_ranks_in_another_pid_namespace_are_judged_by_their_own_threads(in_namespace):
    s = in_namespace
    data = verdict_of(doctor("--pid", str(_torchrun(s)), "--interval", "0.2", "--json"))
    v = data["verdict"]
    # Thread ids looked up under the wrong names made every thread look on-CPU: "straggler".
    assert v["kind"] == "mismatched_collective", v
    assert v["odd_ranks"] == [1]
    ranks = {r["rank"]: r for r in data["ranks"]}
    assert ranks[0]["collective"] == "all_reduce"
    assert ranks[1]["state"] == "idle" and ranks[1]["frame"]["function"] == "wait_for_signal"
    assert sorted(r["pid"] for r in data["ranks"]) == _ranks(s)
    # The scheduler counters were found under the host's thread ids.
    assert all(r["wakeups"] is not None for r in data["ranks"]), data["ranks"]


def test_native_stacks_of_ranks_in_another_pid_namespace(in_namespace):
    s = in_namespace
    res = doctor("--pid", str(_torchrun(s)), "--native", "--samples", "1", "--json")
    data = verdict_of(res)
    assert data["verdict"]["kind"] == "mismatched_collective"
    pid = _ranks(s)[0]
    d = stacks.dump(pid, pyspy=stacks.require_pyspy(), native=True)
    assert d.ok, d.error
    main = d.main_thread()
    assert main is not None and main.os_thread_id == pid  # the host's id, not the namespace's
    assert any(f.native for f in main.frames)
    assert {t.os_thread_id for t in d.threads} <= {int(t) for t in os.listdir(f"/proc/{pid}/task")}


def test_pid_1_is_not_taken_for_a_launcher(in_namespace):
    """init has every job of the host below it: dumping them all is not what was asked."""
    res = doctor("--pid", "1", "--json")
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr
    assert "pid 1 " in res.stderr and "neither a launcher" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""


def test_a_wrapper_holding_one_job_stands_for_it(in_namespace):
    """`unshare` (no launcher, no Python) with one job below it: that job."""
    s = in_namespace
    data = verdict_of(doctor("--pid", str(s.proc.pid), "--interval", "0.2", "--json"))
    assert data["verdict"]["kind"] == "mismatched_collective"
    assert sorted(r["pid"] for r in data["ranks"]) == _ranks(s)


def test_allreduce_names_a_stopped_rank(tmp_path):
    """A SIGSTOPped rank is named as stopped, with its pid and how to resume it; the transport
    is not blamed."""
    argv = [AREAL, "doctor", "allreduce", "--backend", "gloo", "--nproc", "2",
            "--sizes", "1K", "--iters", "100000000", "--warmup", "1", "--timeout", "60",
            "--json"]  # fmt: skip
    env = {**os.environ, "AREAL_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    p = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    pyspy = stacks.require_pyspy()
    stopped = None
    try:

        def rank1_in_loop() -> bool:
            nonlocal stopped
            assert p.poll() is None, p.communicate()
            for c in psutil.Process(p.pid).children(recursive=True):
                try:
                    env, cmd = c.environ(), " ".join(c.cmdline())
                except psutil.Error:
                    continue
                if env.get("RANK") != "1" or "allreduce_repro" not in cmd:
                    continue
                d = stacks.dump(c.pid, pyspy=pyspy)
                main = d.main_thread() if d.ok else None
                if main and any(f.function == "all_reduce" for f in main.frames):
                    stopped = c.pid
                    return True
            return False

        # The run's timeout counts from its start, torch's import included (20 s and more on
        # a loaded host): generous, and the rank must be in its loop well before it.
        assert procs.wait_until(rank1_in_loop, 50, cap=0.3), "rank 1 never reached all_reduce"
        os.kill(stopped, signal.SIGSTOP)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            procs.kill_job(None, [p.pid], grace=1.0)
            p.communicate()
    elapsed = time.monotonic() - started
    assert p.returncode == 3, err.decode()
    data = json.loads(out)
    v = data["hang"]["verdict"]
    assert v["kind"] == "stopped_rank", v
    assert v["odd_ranks"] == [1]
    assert str(stopped) in v["summary"] and "stopped" in v["summary"]
    assert f"kill -CONT {stopped}" in v["hint"]
    assert "transport" not in json.dumps(v)
    ranks = {r["rank"]: r for r in data["hang"]["ranks"]}
    assert ranks[1]["state"] == "stopped" and ranks[1]["frame"]["function"] == "main"
    assert ranks[0]["collective"] == "all_reduce"
    assert not psutil.pid_exists(stopped) or psutil.Process(stopped).status() == "zombie"
    print(f"stopped rank named after {elapsed:.1f}s (timeout 60s)", file=sys.stderr)


def test_stopped_process_is_read_without_attaching(tmp_path):
    """py-spy cannot pause a stopped process; read as it stands, its stack is exact."""
    script = tmp_path / "sleeper.py"
    script.write_text("import time\n\ndef nap():\n    time.sleep(60)\n\nnap()\n")
    p = subprocess.Popen([sys.executable, str(script)])
    try:
        pyspy = stacks.require_pyspy()
        assert procs.wait_until(
            lambda: (
                (d := stacks.dump(p.pid, pyspy=pyspy)).ok
                and any(f.function == "nap" for f in d.threads[0].frames)
            ),
            20,
            cap=0.2,
        )
        os.kill(p.pid, signal.SIGSTOP)
        assert procs.wait_until(lambda: stacks.is_stopped(p.pid), 5, cap=0.05)
        d = stacks.dump(p.pid, pyspy=pyspy)
        assert d.ok and d.stopped, d.error
        assert [f.function for f in d.threads[0].frames][-1] == "<module>"
        assert any(f.function == "nap" for f in d.threads[0].frames)
        assert Path(f"/proc/{p.pid}/status").read_text().count("T (stopped)") == 1
    finally:
        p.kill()
        p.wait()
