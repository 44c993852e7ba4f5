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
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from areal_cli import jobs, procs, settings

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "tests" / "scenarios"
AREAL = str(Path(sys.executable).parent / "areal")
MARK_PREFIX = "doctor-it-"
BUSY = ("spin_straggler", "busy_all")


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


def launch(name: str, nproc: int, tmp: Path, ready_ranks=None, nice: bool = False) -> Scenario:
    marker = f"{MARK_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
    workdir = tmp / name
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
    log = open(workdir / "torchrun.log", "wb")
    proc = procs.spawn(argv, env=env, cwd=workdir, stdout=log)
    log.close()
    return Scenario(name, nproc, proc, marker, workdir, tuple(ready_ranks or range(nproc)))


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


def leftovers() -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["pid"]):
        if _environ(p).get(procs.MARKER_ENV, "").startswith(MARK_PREFIX):
            found.append(p)
    return found


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
        ]:
            started[name] = launch(name, nproc, tmp_module, ready_ranks=ready, nice=name in BUSY)
        # Every worker must exist before the first test starts: the suite's leak check counts
        # what runs at a test's start as not that test's doing.
        for s in started.values():
            s.wait_alive()
        yield started
    finally:
        stoppers = [threading.Thread(target=s.stop) for s in started.values()]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()
        assert not leftovers(), [p.pid for p in leftovers()]


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
    data = verdict_of(doctor("--pid", str(s.proc.pid), "--json"))
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
    data = verdict_of(doctor("--pid", str(s.proc.pid), "--json"))
    v = data["verdict"]
    assert v["kind"] == "missing_rank"
    assert v["missing_ranks"] == [1]
    rank0 = next(r for r in data["ranks"] if r["rank"] == 0)
    assert rank0["collective"] == "init_process_group"
    assert rank0["frame"]["file"].endswith("_scenario.py")  # the user's init_gloo() call


def test_blocked_outside_collective(blocked):
    s = blocked["queue_block"]
    s.wait_ready()
    data = verdict_of(doctor("--pid", str(s.proc.pid), "--json"))
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
    data = verdict_of(doctor("--pid", str(s.proc.pid), "--json"))
    assert data["verdict"]["kind"] == "no_hang"
    assert {r["state"] for r in data["ranks"]} == {"busy"}


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
        supervisor_pid=os.getpid(),
        supervisor_create_time=procs.create_time(os.getpid()),
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
        doctor("--job", "doctor/t0", "--home", str(home), "--json", "--out", str(out))
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
    res = doctor("--pid", str(s.proc.pid))
    assert res.returncode == 0, res.stderr
    assert "verdict: mismatched_collective" in res.stdout
    assert "skip_allreduce.py:21" in res.stdout and "your code" in res.stdout
    assert "odd ranks: 1" in res.stdout


def test_rank_pids_directly(blocked):
    s = blocked["skip_allreduce"]
    s.wait_ready()
    args = [a for p in s.rank_pids() for a in ("--pid", str(p))]
    data = verdict_of(doctor(*args, "--json"))
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
def test_missing_cap_sys_ptrace_is_explained_before_dumping(blocked):
    """Root without CAP_SYS_PTRACE (a container without --cap-add SYS_PTRACE) cannot read
    processes that hold capabilities it lacks: the doctor says so, with the fix, and exits 1."""
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
