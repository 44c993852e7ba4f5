"""`areal doctor hang` against real torchrun jobs (gloo on CPU), one scenario per verdict.

The scenarios under tests/scenarios/ touch ready-<rank> once their main thread sits where the
scenario wants it; the test then runs the real CLI, checks the verdict and the ranks named, and
tears the job down by tree and by environment marker.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from areal_cli import procs, settings
from areal_cli.diagnose import stacks
from areal_cli.schedulers.local import records as jobs

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "tests" / "scenarios"
AREAL = str(Path(sys.executable).parent / "areal")
MARK_PREFIX = "doctor-it-"
BUSY = ("spin_straggler", "busy_all", "allreduce_loop")
# Samples closer together where a test is not about how much the samples prove.
FAST = ("--interval", "0.2")


@dataclass
class Scenario:
    name: str
    nproc: int
    proc: subprocess.Popen
    marker: str
    workdir: Path
    ready_ranks: tuple[int, ...]

    def wait_ready(self, timeout: float = 90.0) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"{self.name}: torchrun exited {self.proc.returncode}\n{self.log()}"
                )
            return all((self.workdir / f"ready-{r}").exists() for r in self.ready_ranks)

        assert procs.wait_until(ready, timeout, cap=0.1), f"{self.name} not ready\n{self.log()}"

    def wait_alive(self, timeout: float = 120.0) -> None:
        def alive() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"{self.name}: torchrun exited {self.proc.returncode}\n{self.log()}"
                )
            return all((self.workdir / f"alive-{r}").exists() for r in range(self.nproc))

        assert procs.wait_until(alive, timeout, cap=0.1), f"{self.name} did not start\n{self.log()}"

    def rank_pids(self) -> list[int]:
        return [c.pid for c in psutil.Process(self.proc.pid).children() if "RANK" in _environ(c)]

    def log(self) -> str:
        try:
            return (self.workdir / "torchrun.log").read_text()[-3000:]
        except OSError:
            return ""

    def stop(self) -> None:
        procs.kill_job(self.marker, [self.proc.pid], grace=2.0)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _environ(p: psutil.Process) -> dict:
    try:
        return p.environ()
    except (psutil.Error, OSError):
        return {}


def launch(
    name: str,
    nproc: int,
    tmp: Path,
    ready_ranks=None,
    nice: bool = False,
    env: dict | None = None,
    label: str | None = None,
    wrap: list[str] | None = None,
) -> Scenario:
    label = label or name
    marker = f"{MARK_PREFIX}{label}-{uuid.uuid4().hex[:8]}"
    workdir = tmp / label
    workdir.mkdir(parents=True)
    port = procs.free_ports(1, start=random.randint(20000, 45000))[0]
    env = {
        **os.environ,
        procs.MARKER_ENV: marker,
        "SCENARIO_DIR": str(workdir),
        "SCENARIO_LIFETIME": "150",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        # Under the run's base temp: the suite's end-of-run sweep finds anything that survived.
        "AREAL_HOME": str(tmp / "home"),
        **(env or {}),
    }
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        str(SCENARIOS / f"{name}.py"),
    ]
    if nice:  # busy-looping ranks must not starve the rest of the suite
        argv = ["nice", "-n", "15", *argv]
    if wrap:  # e.g. unshare --pid --fork: the job in a PID namespace of its own
        argv = [*wrap, *argv]
    log = open(workdir / "torchrun.log", "wb")
    proc = procs.spawn(argv, env=env, cwd=workdir, stdout=log)
    log.close()
    return Scenario(label, nproc, proc, marker, workdir, tuple(ready_ranks or range(nproc)))


def doctor(
    *args: str, timeout: float = 60.0, env: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [AREAL, "doctor", "hang", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def verdict_of(res: subprocess.CompletedProcess) -> dict:
    assert res.returncode == 0, f"exit {res.returncode}\nstdout:{res.stdout}\nstderr:{res.stderr}"
    return json.loads(res.stdout)


def leftovers(*scenarios: Scenario) -> list[psutil.Process]:
    """Live processes of these scenarios (none given: of any scenario). Another test worker
    (pytest -n) runs scenarios of its own meanwhile: a fixture names its own."""
    markers = {s.marker for s in scenarios}
    found = []
    for p in psutil.process_iter(["pid"]):
        marker = _environ(p).get(procs.MARKER_ENV, "")
        if marker in markers if markers else marker.startswith(MARK_PREFIX):
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except psutil.Error:
                continue
    return found


def stop_all(scenarios) -> None:
    """Stop the scenarios at once; then nothing of theirs may be left. A loaded host is slow
    to reap: wait for them to go (generously), then kill what is left and fail naming it."""
    scenarios = list(scenarios)
    stoppers = [threading.Thread(target=s.stop) for s in scenarios]
    for t in stoppers:
        t.start()
    for t in stoppers:
        t.join()
    if procs.wait_until(lambda: not leftovers(*scenarios), 60, cap=0.5):
        return
    left = leftovers(*scenarios)
    desc = []
    for p in left:
        try:
            desc.append(f"{p.pid} {p.status()} {' '.join(p.cmdline())[:100]}")
        except psutil.Error:
            continue
    procs.terminate(left, grace=1.0)
    raise AssertionError(f"left behind: {desc}")


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tmp_module(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("doctor-hang")


@pytest.fixture(scope="module")
def blocked(tmp_module):
    """Every scenario, started together to share the start-up wait (torch imports dominate).

    The busy ones idle until their test writes `go`, so they burn CPU only while tested.
    """
    started: dict[str, Scenario] = {}
    try:
        for name, nproc, ready in [
            ("skip_allreduce", 2, None),
            ("different_collectives", 3, None),
            ("exit_early", 2, [0]),
            ("queue_block", 2, None),
            ("spin_straggler", 2, None),
            ("busy_all", 2, None),
            ("allreduce_loop", 2, None),
        ]:
            started[name] = launch(name, nproc, tmp_module, ready_ranks=ready, nice=name in BUSY)
        for stall in ("forward", "backward"):
            label = f"fsdp2_{stall}"
            started[label] = launch("fsdp2_stall", 2, tmp_module, env={"STALL": stall}, label=label)
        # Every worker must exist before the first test starts: the suite's leak check counts
        # what runs at a test's start as not that test's doing.
        for s in started.values():
            s.wait_alive()
        yield started
    finally:
        stop_all(started.values())


@pytest.fixture
def busy(blocked):
    """Start a busy scenario's loop; stop the scenario when the test ends."""
    used: list[Scenario] = []

    def go(name: str) -> Scenario:
        s = blocked[name]
        used.append(s)
        (s.workdir / "go").touch()
        return s

    yield go
    for s in used:
        s.stop()


# --------------------------------------------------------------------------- verdicts


def test_mismatched_collective(blocked):
    s = blocked["skip_allreduce"]
    s.wait_ready()
    data = verdict_of(doctor("--pid", str(s.proc.pid), "--json"))
    v = data["verdict"]
    assert v["kind"] == "mismatched_collective"
    assert v["odd_ranks"] == [1]
    assert v["hang"] and v["confidence"] == "high" and data["samples"] == 3
    ranks = {r["rank"]: r for r in data["ranks"]}
    assert ranks[0]["collective"] == "all_reduce" and ranks[0]["state"] == "collective"
    assert ranks[0]["frame"]["file"].endswith("skip_allreduce.py")
    assert ranks[0]["frame"]["code"] == "dist.all_reduce(t)"
    assert ranks[1]["frame"]["function"] == "wait_for_signal"
    assert sorted(r["pid"] for r in data["ranks"]) == sorted(s.rank_pids())
    assert [g["ranks"] for g in data["groups"]] == [[0], [1]]


def test_collective_type_mismatch(blocked):
    s = blocked["different_collectives"]
    s.wait_ready()
    data = verdict_of(doctor("--pid", str(s.proc.pid), *FAST, "--json"))
    v = data["verdict"]
    assert v["kind"] == "collective_type_mismatch"
    assert v["odd_ranks"] == [2]
    assert {r["rank"]: r["collective"] for r in data["ranks"]} == {
        0: "all_reduce",
        1: "all_reduce",
        2: "send/recv",
    }


def test_missing_rank_during_init(blocked):
    s = blocked["exit_early"]
    s.wait_ready()
    assert procs.wait_until(lambda: len(s.rank_pids()) == 1, 30), "rank 1 did not exit"
    data = verdict_of(doctor("--pid", str(s.proc.pid), *FAST, "--json"))
    v = data["verdict"]
    assert v["kind"] == "missing_rank"
    assert v["missing_ranks"] == [1]
    rank0 = next(r for r in data["ranks"] if r["rank"] == 0)
    assert rank0["collective"] == "init_process_group"
    assert rank0["frame"]["file"].endswith("_scenario.py")  # the user's init_gloo() call


def test_blocked_outside_collective(blocked):
    s = blocked["queue_block"]
    s.wait_ready()
    data = verdict_of(doctor("--pid", str(s.proc.pid), *FAST, "--json"))
    v = data["verdict"]
    assert v["kind"] == "blocked_outside_collective"
    assert v["odd_ranks"] == []
    assert all(r["state"] == "idle" for r in data["ranks"])
    assert {r["frame"]["function"] for r in data["ranks"]} == {"next_batch"}
    assert [g["ranks"] for g in data["groups"]] == [[0, 1]]


def test_straggler_is_stuck_across_samples(busy):
    s = busy("spin_straggler")
    s.wait_ready()
    data = verdict_of(
        doctor("--pid", str(s.proc.pid), "--samples", "3", "--interval", "0.2", "--json")
    )
    v = data["verdict"]
    assert v["kind"] == "straggler"
    assert v["odd_ranks"] == [1]
    ranks = {r["rank"]: r for r in data["ranks"]}
    assert ranks[1]["state"] == "busy" and ranks[1]["progress"] == "stuck"
    assert ranks[0]["collective"] == "all_reduce"
    assert data["samples"] == 3


def test_no_hang_when_ranks_compute(busy):
    s = busy("busy_all")
    s.wait_ready()
    data = verdict_of(doctor("--pid", str(s.proc.pid), *FAST, "--json"))
    assert data["verdict"]["kind"] == "no_hang"
    assert {r["state"] for r in data["ranks"]} == {"busy"}


def test_fsdp2_forward_hang_waits_in_all_gather_single(blocked):
    s = blocked["fsdp2_forward"]
    s.wait_ready()
    data = verdict_of(doctor("--pid", str(s.proc.pid), *FAST, "--json"))
    v = data["verdict"]
    assert v["kind"] == "mismatched_collective" and v["odd_ranks"] == [1]
    assert v["hang"] and v["confidence"] == "high"
    rank0, rank1 = data["ranks"]
    assert (rank0["collective"], rank0["op"]) == ("all_gather", "all_gather_single")
    assert rank0["frame"]["code"] == "loss = model(batch).sum()"
    assert rank1["frame"]["function"] == "stall"


def test_fsdp2_backward_hang_waits_in_reduce_scatter_single(blocked):
    s = blocked["fsdp2_backward"]
    s.wait_ready()
    data = verdict_of(doctor("--pid", str(s.proc.pid), *FAST, "--json"))
    v = data["verdict"]
    assert v["kind"] == "mismatched_collective" and v["odd_ranks"] == [1]
    rank0 = data["ranks"][0]
    assert (rank0["collective"], rank0["op"]) == ("reduce_scatter", "reduce_scatter_single")
    assert rank0["frame"]["code"] == "loss.backward()"


def test_a_healthy_allreduce_loop_is_never_called_a_hang(busy):
    """Ranks that all-reduce step after step sit in the all_reduce in almost every snapshot;
    across the default samples they are seen to move, run after run."""
    s = busy("allreduce_loop")
    s.wait_ready()
    for _ in range(4):
        data = verdict_of(doctor("--pid", str(s.proc.pid), "--json"))
        v = data["verdict"]
        assert v["kind"] in ("no_hang", "progressing"), v
        assert not v["hang"] and v["confidence"] == "high"
        assert data["samples"] == 3
    # One snapshot mostly finds the ranks inside all_reduce: it says how little that proves.
    snapshot = verdict_of(doctor("--pid", str(s.proc.pid), "--samples", "1", "--json"))
    assert snapshot["verdict"]["confidence"] == "low"


def test_a_still_rank_is_not_dumped_again(blocked):
    """A rank none of whose Python threads ran since the last sample keeps its dump."""
    s = blocked["queue_block"]
    s.wait_ready()
    pids = s.rank_pids()
    pyspy = stacks.require_pyspy()
    first = stacks.dump_many(pids, pyspy=pyspy)
    again = stacks.dump_many(pids, pyspy=pyspy, previous=first)
    assert all(d.ok and not d.reused for d in first.values())
    assert all(d.reused for d in again.values())
    assert all(set(d.ran.values()) == {0} for d in again.values())


def test_the_last_sample_reads_no_counters_for_a_next_one(blocked):
    """`counters=False` (the doctor's last sample): what ran since the previous sample is
    still known, the counters a next sample would compare against are not read."""
    s = blocked["queue_block"]
    s.wait_ready()
    pids = s.rank_pids()
    pyspy = stacks.require_pyspy()
    first = stacks.dump_many(pids, pyspy=pyspy)
    last = stacks.dump_many(pids, pyspy=pyspy, previous=first, counters=False)
    assert all(d.ok and d.counters for d in first.values())
    assert all(d.ran is not None for d in last.values())
    fresh = stacks.dump_many(pids, pyspy=pyspy, counters=False)
    assert all(d.ok and d.threads and not d.counters for d in fresh.values())


def test_cancelled_dumps_start_no_more_py_spy(tmp_path):
    """The doctor checks permissions while its first dumps run; an attach it finds impossible
    cancels them: the py-spy under way is killed and no further one starts."""
    slow = tmp_path / "py-spy"
    slow.write_text(f"#!/bin/sh\necho $$ >> {tmp_path}/started\nexec sleep 60\n")
    slow.chmod(0o755)
    started = tmp_path / "started"
    pending = stacks.start_many([os.getpid(), 1], pyspy=str(slow), timeout=60, workers=1)
    assert procs.wait_until(started.exists, 20)
    pending.cancel()
    t0 = time.monotonic()
    dumps = pending.wait()
    assert time.monotonic() - t0 < 5
    assert len(started.read_text().split()) == 1
    assert not dumps[os.getpid()].ok and 1 not in dumps  # killed; never started
    pid = int(started.read_text())
    assert procs.wait_until(lambda: not psutil.pid_exists(pid), 5)


def start_exiting(tmp: Path, exit_ranks: str) -> list[subprocess.Popen]:
    """Two plain rank processes of exit_on_dump.py; `exit_ranks` exit once dumped."""
    workdir = tmp / "exiting"
    workdir.mkdir()
    ps = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "SCENARIO_DIR": str(workdir),
            "SCENARIO_LIFETIME": "60",
            "EXIT_RANKS": exit_ranks,
        }
        argv = [sys.executable, str(SCENARIOS / "exit_on_dump.py")]
        ps.append(procs.spawn(argv, env=env, stdout=subprocess.DEVNULL))
    marks = [workdir / f"ready-{r}" for r in (0, 1)]
    marks += [workdir / f"armed-{r}" for r in map(int, exit_ranks.split(","))]
    assert procs.wait_until(lambda: all(f.exists() for f in marks), 30)
    return ps


def test_targets_that_exit_during_the_dump_are_named_not_a_traceback(tmp_path):
    ps = start_exiting(tmp_path, "0,1")
    try:
        res = doctor(*[a for p in ps for a in ("--pid", str(p.pid))], "--json")
        assert res.returncode == 2, res.stdout + res.stderr
        assert "exited during the dump" in res.stderr
        assert str(ps[0].pid) in res.stderr
        assert "Traceback" not in res.stderr and "NoSuchProcess" not in res.stderr
    finally:
        for p in ps:
            p.kill()
            p.wait()


def test_a_rank_that_exits_during_the_dump_is_the_missing_rank(tmp_path):
    ps = start_exiting(tmp_path, "1")
    try:
        data = verdict_of(doctor("--pid", str(ps[0].pid), "--pid", str(ps[1].pid), "--json"))
        assert data["verdict"]["kind"] == "missing_rank"
        assert data["verdict"]["missing_ranks"] == [1]
        assert data["ranks"][1]["error"] == "the process exited during the dump"
        assert data["ranks"][0]["frame"]["function"] == "next_batch"
    finally:
        for p in ps:
            p.kill()
            p.wait()


# --------------------------------------------------------------------------- targets and output


def test_job_record_target_and_out_bundle(blocked, tmp_path):
    s = blocked["skip_allreduce"]
    s.wait_ready()
    home = tmp_path / "home"
    rec = jobs.JobRecord(
        experiment="doctor",
        trial="t0",
        kind="train",
        state="running",
        marker=s.marker,
        # The job's own tree: torchrun stands in for the supervisor above it.
        supervisor_pid=s.proc.pid,
        supervisor_create_time=procs.create_time(s.proc.pid),
        host=settings.hostname(),
        started=time.time(),
        log_dir=str(tmp_path),
        registry=str(tmp_path / "reg"),
        processes=[
            jobs.ProcessRecord(role="trainer", index=0, pid=s.proc.pid, argv=["torchrun"], log="x")
        ],
    )
    jobs.write(home, rec)
    out = tmp_path / "bundle"
    data = verdict_of(
        doctor("--job", "doctor/t0", "--home", str(home), *FAST, "--json", "--out", str(out))
    )
    assert data["verdict"]["kind"] == "mismatched_collective"
    assert data["job"]["name"] == "doctor/t0"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"]["odd_ranks"] == [1]
    raw = sorted(p.name for p in out.glob("rank*.json"))
    assert len(raw) == 2 and raw[0].startswith("rank0-pid")
    assert json.loads((out / raw[0]).read_text())[0]["frames"]


def test_rich_tree_output_names_the_user_frame(blocked):
    s = blocked["skip_allreduce"]
    s.wait_ready()
    res = doctor("--pid", str(s.proc.pid), *FAST)
    assert res.returncode == 0, res.stderr
    assert "verdict: mismatched_collective" in res.stdout
    assert "skip_allreduce.py:21" in res.stdout and "your code" in res.stdout
    assert "odd ranks: 1" in res.stdout


RECORD = """
import atexit, json, os, sys
atexit.register(lambda: json.dump(sorted(sys.modules), open(os.environ["MODULES_OUT"], "w")))
sys.argv = ["areal", *sys.argv[1:]]
from areal_cli.cli import main
main()
"""


def test_json_output_imports_neither_torch_nor_rich(blocked, tmp_path):
    """The doctor reads stacks from outside: it never pays for torch, nor rich for --json."""
    s = blocked["queue_block"]
    s.wait_ready()
    modules = tmp_path / "modules.json"
    res = subprocess.run(
        [sys.executable, "-c", RECORD, "doctor", "hang", "--pid", str(s.proc.pid), *FAST, "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "MODULES_OUT": str(modules)},
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["verdict"]["kind"] == "blocked_outside_collective"
    roots = {m.split(".")[0] for m in json.loads(modules.read_text())}
    assert not roots & {"torch", "rich", "concurrent"}, sorted(roots & {"torch", "rich"})


def test_rank_pids_directly(blocked):
    s = blocked["skip_allreduce"]
    s.wait_ready()
    args = [a for p in s.rank_pids() for a in ("--pid", str(p))]
    data = verdict_of(doctor(*args, *FAST, "--json"))
    assert data["verdict"]["kind"] == "mismatched_collective"


def test_bad_targets_exit_2(tmp_path):
    gone = 4_000_000
    while psutil.pid_exists(gone):
        gone += 1
    res = doctor("--pid", str(gone))
    assert res.returncode == 2 and "no process with pid" in res.stderr
    assert "Traceback" not in res.stderr

    sleeper = procs.spawn(["sleep", "60"], env=dict(os.environ), stdout=subprocess.DEVNULL)
    try:
        res = doctor("--pid", str(sleeper.pid))
        assert res.returncode == 2 and "not a Python process" in res.stderr
    finally:
        sleeper.kill()
        sleeper.wait()

    res = doctor("--job", "no-slash")
    assert res.returncode == 2 and "EXPERIMENT/TRIAL" in res.stderr
    res = doctor("--job", "nope/never", "--home", str(tmp_path))
    assert res.returncode == 2 and "no job nope/never" in res.stderr


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv"
)
def test_missing_cap_sys_ptrace_is_explained_with_the_fix(blocked):
    """Root without CAP_SYS_PTRACE (a container without --cap-add SYS_PTRACE) cannot read
    processes that hold capabilities it lacks: the doctor says so, with the fix, and exits 1
    (the check runs beside the first dumps and stops them)."""
    s = blocked["queue_block"]
    s.wait_ready()
    res = subprocess.run(
        [
            "setpriv",
            "--bounding-set",
            "-sys_ptrace",
            "--inh-caps",
            "-sys_ptrace",
            AREAL,
            "doctor",
            "hang",
            "--pid",
            str(s.proc.pid),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert "CAP_SYS_PTRACE" in res.stderr
    assert "--cap-add SYS_PTRACE" in res.stderr


def test_ranks_are_read_from_proc_as_psutil_reads_them(tmp_path):
    """targets.Proc stands in for psutil.Process (whose import was a fifth of the start-up):
    on real processes (a Python one with odd arguments and environment, a shell's, this one,
    a zombie) it reads the same."""
    from areal_cli.diagnose import targets

    env = {**os.environ, "RANK": "3", "ODD_VALUE": "a=b c"}
    live = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "two words"], env=env
    )
    shell = subprocess.Popen(["sleep", "60"])
    zombie = subprocess.Popen(["true"])
    try:
        assert procs.wait_until(lambda: psutil.Process(zombie.pid).status() == "zombie", 10)
        for pid in (live.pid, shell.pid, os.getpid()):
            ours, theirs = targets.Proc(pid), psutil.Process(pid)
            assert ours.cmdline() == theirs.cmdline()
            assert ours.environ() == theirs.environ()
            assert ours.exe() == theirs.exe()
            assert ours.name() == theirs.name()
            assert ours.status() == theirs.status()
            assert ours.real_uid() == theirs.uids().real
        assert targets.Proc(live.pid).environ()["ODD_VALUE"] == "a=b c"
        z = targets.Proc(zombie.pid)
        assert z.status() == targets.ZOMBIE == psutil.STATUS_ZOMBIE
        assert z.cmdline() == []  # psutil raises ZombieProcess here; targets skips zombies first
        res = doctor("--pid", str(zombie.pid))
        assert res.returncode == 2 and "zombie" in res.stderr, res.stderr
    finally:
        for p in (live, shell):
            p.kill()
            p.wait()
        zombie.wait()
    with pytest.raises(targets.NoSuchProcess):
        targets.Proc(live.pid)


def test_a_py_spy_too_old_for_the_ranks_python_is_named(tmp_path, monkeypatch):
    """py-spy's version is asked while the first dumps run (not before them): a release too
    old for the ranks' Python still ends in the one message naming it, with the fix."""
    from areal_cli.diagnose import attach, hang, targets

    real = stacks.require_pyspy()
    old = tmp_path / "py-spy"
    old.write_text(
        '#!/bin/sh\nif [ "$1" = --version ]; then echo "py-spy 0.3.13"; exit 0; fi\n'
        f'exec {real} "$@"\n'
    )
    old.chmod(0o755)
    monkeypatch.setattr(stacks, "find_pyspy", lambda: str(old))
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        jobs = targets.resolve(pids=[rank.pid])
        with pytest.raises(attach.AttachError) as e:
            hang.diagnose(jobs, samples=1)
    finally:
        rank.kill()
        rank.wait()
    assert "py-spy 0.3.13 cannot read Python 3." in e.value.message
    assert "pip install -U py-spy" in e.value.hint


@pytest.fixture
def stand_in_pyspy(tmp_path):
    """(start, started): start(pids, send_int) runs a process that dumps `pids` with a py-spy
    that never finishes (600 s; the doctor's timeout is as long) and appends its pid to
    `started`; with send_int, the first py-spy to start sends the doctor SIGINT (a Ctrl-C at
    the moment the dumps begin). The py-spy lead sessions of their own, as under the doctor.
    After the test, whatever happened, the doctors' and every py-spy's groups are killed."""
    started = tmp_path / "started"
    slow = tmp_path / "py-spy"
    slow.write_text(
        f"#!/bin/sh\necho $$ >> {started}\n"
        f'[ -n "$INT_PID" ] && mkdir "{tmp_path}/sent" 2>/dev/null && kill -INT "$INT_PID"\n'
        "exec sleep 600\n"
    )
    slow.chmod(0o755)
    doctors: list[subprocess.Popen] = []
    seen: set[int] = set()

    def start(pids: list[int], send_int: bool) -> subprocess.Popen:
        for leftover in (started, tmp_path / "sent"):
            if leftover.is_dir():
                leftover.rmdir()
            elif leftover.exists():
                seen.update(int(p) for p in leftover.read_text().split())
                leftover.unlink()
        script = (
            "import os, signal; from areal_cli.diagnose import stacks\n"
            # Ctrl-C as at a terminal, even when this suite runs in the background (where
            # the shell started it with SIGINT ignored, and Python keeps it so).
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            + ("os.environ['INT_PID'] = str(os.getpid())\n" if send_int else "")
            + f"stacks.start_many({pids}, pyspy={str(slow)!r}, timeout=600, "
            f"workers={len(pids)}).wait()"
        )
        doc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE,
                               text=True, start_new_session=True)  # fmt: skip
        doctors.append(doc)
        return doc

    yield start, started
    for pid in (
        [d.pid for d in doctors]
        + sorted(seen)
        + ([int(p) for p in started.read_text().split()] if started.exists() else [])
    ):
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    for doc in doctors:
        doc.wait()


def _ended_by_ctrl_c(doc: subprocess.Popen, started: Path, n: int) -> None:
    """The doctor ended on the KeyboardInterrupt, not on a py-spy timeout (600 s), and every
    py-spy it started is gone."""
    _, err = doc.communicate(timeout=120)  # generous for a loaded host; the bug waits 600 s
    assert "KeyboardInterrupt" in err, err
    pids = [int(p) for p in started.read_text().split()]
    assert 1 <= len(pids) <= n
    # Killed and reaped by the doctor before it exited: not even a zombie is left.
    assert not [p for p in pids if psutil.pid_exists(p)], pids


def test_ctrl_c_during_the_dumps_leaves_no_py_spy_behind(stand_in_pyspy):
    """py-spy runs in a session of its own (a timeout kills its group), so Ctrl-C does not
    reach it: the doctor kills every py-spy still under way, none keeps a rank paused."""
    start, started = stand_in_pyspy
    doc = start([os.getpid(), 1], send_int=False)
    assert procs.wait_until(
        lambda: started.exists() and len(started.read_text().split()) == 2, 120
    ), "the two py-spy never started"
    doc.send_signal(signal.SIGINT)
    _ended_by_ctrl_c(doc, started, 2)


def test_ctrl_c_while_the_dump_threads_start_leaves_no_py_spy_behind(stand_in_pyspy):
    """The Ctrl-C comes as the first py-spy starts, while the doctor may still be starting
    the other dump threads (before it waits on them): it used to wait out every py-spy's
    timeout. Where the signal lands varies from run to run: five runs."""
    start, started = stand_in_pyspy
    for _ in range(5):
        _ended_by_ctrl_c(start([os.getpid(), 1, os.getppid()], send_int=True), started, 3)
