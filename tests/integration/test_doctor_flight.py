"""The doctor channel and the flight recorder, against real torchrun jobs (gloo on CPU) on
areal's worker runtime: the ranks' main threads sit in a collective that never completes and a
thread of their own answers; `areal doctor hang` joins the recorder with the stacks.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_doctor_hang import doctor, launch, stop_all, verdict_of

from areal_cli import procs
from areal_cli.diagnose import flight
from areal_cli.worker import channel

RECORDER = {"TORCH_FR_BUFFER_SIZE": "2000"}


@pytest.fixture(scope="module")
def hung(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("doctor-flight")
    started = {}
    try:
        for name in ("shape_mismatch", "wrong_group"):
            started[name] = launch(name, 2, tmp, env=RECORDER)
        for s in started.values():
            s.wait_alive()
        yield started
    finally:
        stop_all(started.values())


def wait_for(s, expect: dict[int, tuple[str, int]], timeout: float = 90.0) -> dict:
    """Until each rank's recorder says it waits in (group desc, collective number)."""
    last: dict = {}

    def there() -> bool:
        nonlocal last
        if s.proc.poll() is not None:
            raise AssertionError(f"{s.name}: torchrun exited {s.proc.returncode}\n{s.log()}")
        last = {}
        for f in flight.gather(s.rank_pids()).values():
            if isinstance(f, flight.RankFlight) and (p := f.pending()) is not None:
                last[f.rank] = (p.desc, p.seq)
        return last == expect

    assert procs.wait_until(there, timeout, cap=0.2), f"{s.name}: {last}\n{s.log()}"
    return last


def test_a_rank_blocked_in_a_collective_answers_its_channel(hung):
    s = hung["wrong_group"]
    wait_for(s, {0: ("dp", 1), 1: ("tp", 1)})
    for pid in s.rank_pids():
        t0 = time.monotonic()
        ping = channel.ask(pid, "ping")
        assert ping["pid"] == pid and {"fr", "progress", "ping"} <= set(ping["ops"])
        prog = channel.ask(pid, "progress")
        assert prog["step"] == 0 and prog["count"] == 1 and prog["time"] < time.time()
        answer = channel.ask(pid, "fr")
        assert time.monotonic() - t0 < 2.0
        assert answer["buffer_size"] == 2000
        assert answer["groups"]["1"] == {"desc": "dp", "ranks": [0, 1]}
        # Private: the folder is the user's own, closed to everybody else.
        sock = channel.find(pid)
        assert sock is not None and (sock.parent.stat().st_mode & 0o777) == 0o700
    with pytest.raises(channel.ChannelError) as e:
        channel.ask(pid, "no-such-request")
    assert "unknown request" in str(e.value)


def test_shape_mismatch_from_a_real_gloo_job(hung, tmp_path):
    s = hung["shape_mismatch"]
    wait_for(s, {0: ("default_pg", 3), 1: ("default_pg", 2)})
    data = verdict_of(doctor("--pid", str(s.proc.pid), "--json", "--out", str(tmp_path / "b")))
    v = data["verdict"]
    assert v["kind"] == "shape_mismatch" and v["odd_ranks"] == [1]
    assert "rank 0 [1048576] Float; rank 1 [2097152] Float" in v["summary"]
    assert {r: e["seq"] for r, e in v["reached"].items()} == {"0": 3, "1": 2}
    # torch's own analyzer, run on the repaired dumps, agrees.
    said = " ".join(data["flight"]["torch_analysis"])
    assert "SIZE_OR_SYNTAX_MISMATCH" in said and "Culprit rank 1" in said
    assert any(e.startswith("torch's analyzer: error msg") for e in v["evidence"])
    fr_dir = tmp_path / "b" / "flight-recorder"
    assert sorted(p.name for p in fr_dir.iterdir()) == ["rank0.json", "rank1.json", "torch"]
    assert sorted(p.name for p in (fr_dir / "torch").iterdir()) == ["fr_trace_0", "fr_trace_1"]


def test_wrong_group_from_a_real_gloo_job(hung):
    s = hung["wrong_group"]
    wait_for(s, {0: ("dp", 1), 1: ("tp", 1)})
    res = doctor("--pid", str(s.proc.pid))
    assert res.returncode == 0, res.stderr
    assert "verdict: wrong_group" in res.stdout
    assert "rank 0 in group dp (#1 all_reduce); rank 1 in group tp" in " ".join(res.stdout.split())
    assert "rank 1: collective #1 of group tp (all_reduce [4] Float, scheduled)" in res.stdout


def test_torch_analyzer_needs_the_repaired_pg_config(hung, tmp_path):
    """What gloo records as it is crashes torch's analyzer; the repaired copy reads."""
    s = hung["wrong_group"]
    wait_for(s, {0: ("dp", 1), 1: ("tp", 1)})
    got = [f for f in flight.gather(s.rank_pids()).values() if isinstance(f, flight.RankFlight)]
    raw = tmp_path / "raw"
    raw.mkdir()
    for f in got:
        (raw / f"fr_trace_{f.rank}").write_bytes(pickle.dumps(f.raw))
    argv = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(raw),
            "--prefix", "fr_trace_", "--allow-incomplete-ranks"]  # fmt: skip
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "KeyError: ('0', 0)" in res.stderr
    said = flight.torch_analysis(got, sys.executable, tmp_path / "fixed")
    assert any("Not all ranks joining collective" in line for line in said), said


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to ask as another uid")
def test_another_user_is_refused():
    # Not under pytest's base temp, whose top folder only root enters.
    top = Path(tempfile.mkdtemp(prefix="areal-channel-"))
    home = top / "h"
    server = channel.Server(Path(channel._private_dir(channel.channel_dir(home))) / "1.sock")
    try:
        assert channel.ask_path(server.path, "ping")["pid"] == os.getpid()
        # Stdlib only, under the system's Python: the venv may live where only root enters.
        probe = (
            "import socket, sys\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "try:\n"
            f"    s.connect({str(server.path)!r})\n"
            "except OSError as e:\n"
            "    sys.exit(print(e))\n"
            's.sendall(b\'{"op": "ping"}\\n\')\n'
            "print(s.recv(4096).decode())\n"
        )
        py = shutil.which("python3", path="/usr/bin")
        if py is None or shutil.which("setpriv") is None:
            pytest.skip("needs /usr/bin/python3 and setpriv")

        def as_nobody() -> str:
            res = subprocess.run(
                ["setpriv", "--reuid=4242", "--regid=4242", "--clear-groups", py, "-c", probe],
                capture_output=True,
                text=True,
                timeout=30,
                cwd="/",
            )
            return res.stdout + res.stderr

        # The folder keeps others out; opened by mistake, the server still refuses them.
        assert "Permission denied" in as_nobody()
        os.chmod(server.path.parent, 0o755)
        os.chmod(server.path, 0o777)
        for p in (top, home, home / "run"):
            os.chmod(p, 0o755)
        out = as_nobody()
        assert "refused: uid 4242 is not this job's user" in out, out
    finally:
        server.close()
        shutil.rmtree(top)
    assert not server.path.exists()
