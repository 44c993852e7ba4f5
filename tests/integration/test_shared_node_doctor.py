"""A shared node, the doctor's side: another local user (uid 4242, a real other uid via setpriv)
plants folders, links and sockets where a rank's doctor channel falls back to, and root's
doctor must neither serve there nor believe what answers there."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from areal_cli.diagnose import watchdog
from areal_cli.worker import channel
from tests.helpers import AREAL

OTHER = 4242  # a uid no one uses here

pytestmark = pytest.mark.skipif(
    os.getuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to act as another user",
)

# A rank's channel as the worker runtime starts it, on the stdlib and our package only: it says
# its pid, waits for a line (the other user plants meanwhile), starts, says where, waits again.
RANK = """
import json, logging, os, sys
logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
from areal_cli.worker import channel
print(os.getpid(), flush=True)
sys.stdin.readline()
s = channel.start(os.environ["AREAL_HOME"])
print(json.dumps({"path": str(s.path) if s else None}), flush=True)
sys.stdin.readline()
"""

# The other user's forgery: a socket named after the rank's pid that answers every request,
# with a progress count that grows (a stall hidden) and a flight recording of a collective in
# a group it invented. Each request it gets is written to `asked` (so a test sees none came).
FAKE = r"""
import json, os, socket, sys, time
folder, pid, asked = sys.argv[1], int(sys.argv[2]), sys.argv[3]
os.makedirs(folder, exist_ok=True)
path = os.path.join(folder, f"{pid}.sock")
s = socket.socket(socket.AF_UNIX)
s.bind(path)
os.chmod(path, 0o777)
s.listen(16)
print("ready", flush=True)
n = 0
entry = {"process_group": ["66", "forged_group"], "collective_seq_id": 7, "record_id": 1,
         "profiling_name": "gloo:all_reduce", "input_sizes": [[4]], "output_sizes": [[4]],
         "input_dtypes": ["Float"], "state": "scheduled"}
while True:
    c, _ = s.accept()
    with c:
        data = b""
        while b"\n" not in data:
            chunk = c.recv(65536)
            if not chunk:
                break
            data += chunk
        if b"\n" not in data:
            continue
        req = json.loads(data.split(b"\n")[0])
        n += 1
        with open(asked, "a") as f:
            f.write(req.get("op", "?") + "\n")
        result = {"pid": pid, "rank": 0, "count": n, "step": n, "time": time.time(),
                  "source": "step", "world_size": 2, "ops": ["fr", "ping", "progress"],
                  "groups": {"66": {"desc": "forged_group", "ranks": [0, 1]}},
                  "dump": {"entries": [entry]}, "buffer_size": 2000}
        c.sendall(json.dumps({"ok": True, "result": result}).encode() + b"\n")
"""


def as_other(*argv: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        ["setpriv", f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups", *argv], **kw
    )


class Rank:
    """A real process serving a rank's channel (as root, or as the other user)."""

    def __init__(self, env: dict, user: int | None = None):
        # A script file, as a rank runs (`python -c "...areal_cli..."` reads as a launcher).
        script = Path(env["TMPDIR"]) / "rank.py"
        if not script.exists():
            script.write_text(RANK)
            os.chmod(script, 0o644)
        argv = [sys.executable, str(script)]
        if user is not None:
            argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv]
        self.proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, cwd="/",
        )  # fmt: skip
        self.pid = int(self.proc.stdout.readline())
        assert self.pid == self.proc.pid  # setpriv execs: the rank is the process we started

    def start(self) -> str | None:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["path"]

    def close(self) -> str:
        """Ends it; its stderr (what it warned)."""
        try:
            _, err = self.proc.communicate("\n\n", timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return err


@pytest.fixture
def node():
    """A sticky folder standing for /tmp (TMPDIR, so the real /tmp/areal-0 of other tests is
    not touched), a long AREAL_HOME that makes ranks fall back there, and the rank's env."""
    tmp = Path(tempfile.mkdtemp(prefix="areal-node-", dir="/tmp"))
    os.chmod(tmp, 0o1777)
    home = tmp / "home" / ("h" * 90)  # <home>/run/doctor/<pid>.sock is past 107 bytes
    home.mkdir(parents=True)
    for p in (tmp / "home", home):
        os.chmod(p, 0o777)  # the other user's ranks share it in one test
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env.update(TMPDIR=str(tmp), AREAL_HOME=str(home))
    started: list = []
    yield {"tmp": tmp, "home": home, "env": env, "started": started}
    for p in started:
        if isinstance(p, Rank):
            p.close()
        else:
            p.kill()
            p.wait()
    shutil.rmtree(tmp, ignore_errors=True)


def _plant_server(node, folder: Path, pid: int) -> Path:
    """The other user's socket `<folder>/<pid>.sock` (its folders its own); the file it logs
    requests to."""
    asked = node["tmp"] / "asked"
    asked.touch()
    os.chmod(asked, 0o666)
    fake = as_other("/usr/bin/python3", "-c", FAKE, str(folder), str(pid), str(asked),
                    stdout=subprocess.PIPE, text=True, cwd="/")  # fmt: skip
    node["started"].append(fake)
    assert fake.stdout.readline().strip() == "ready"
    assert os.lstat(folder / f"{pid}.sock").st_uid == OTHER
    return asked


def _run_other(*argv: str) -> None:
    p = as_other(*argv, cwd="/")
    assert p.wait(timeout=60) == 0


# -- 1. the fallback folder -----------------------------------------------------------------


@pytest.mark.parametrize(
    "layout",
    ["their folder, a link to root's", "their folder, a link to /tmp", "our open folder, a link"],
)
def test_a_rank_serves_nowhere_another_user_planted_and_chmods_nothing(node, layout):
    tmp = node["tmp"]
    victim = tmp if "/tmp" in layout else tmp / "victim"
    if victim != tmp:
        victim.mkdir()
        os.chmod(victim, 0o755)
    top = tmp / "areal-0"
    if layout.startswith("our"):
        # Left open by an earlier run under umask 000: the other user may add entries to it.
        top.mkdir()
        os.chmod(top, 0o777)
    else:
        _run_other("mkdir", "-m", "0755", str(top))
    _run_other("ln", "-s", str(victim), str(top / "doctor"))
    before = stat.S_IMODE(os.stat(victim).st_mode)

    rank = Rank(node["env"])
    node["started"].append(rank)
    assert rank.start() is None  # no channel; the rank runs on
    err = rank.close()
    node["started"].remove(rank)
    assert "doctor channel not started" in err, err
    why = "is a symbolic link" if layout.startswith("our") else f"belongs to uid {OTHER}"
    assert f"{top}" in err and why in err, err
    assert "Traceback" not in err
    # Nothing was changed or bound through the link.
    assert stat.S_IMODE(os.stat(victim).st_mode) == before
    assert not list(victim.glob("*.sock"))
    assert os.path.islink(top / "doctor")
    if layout.startswith("our"):
        assert stat.S_IMODE(os.lstat(top).st_mode) == 0o700  # ours: closed again


def test_the_rank_and_root_doctor_agree_on_a_user_fallback_folder(node):
    # A rank of the other user: its fallback is that user's /tmp/areal-<uid>, and root's doctor
    # (another uid) looks for it there, not in /tmp/areal-0.
    rank = Rank(node["env"], user=OTHER)
    node["started"].append(rank)
    path = rank.start()
    assert path == str(node["tmp"] / f"areal-{OTHER}" / "doctor" / f"{rank.pid}.sock")
    for p in (node["tmp"] / f"areal-{OTHER}", Path(path).parent):
        st = os.lstat(p)
        assert st.st_uid == OTHER and stat.S_IMODE(st.st_mode) == 0o700
    assert channel.find(rank.pid) == Path(path)
    assert channel.ask(rank.pid, "ping")["pid"] == rank.pid
    rank.close()
    node["started"].remove(rank)
    assert not Path(path).exists()  # cleaned up by the folder it checked


def test_the_users_private_runtime_folder_is_preferred(node):
    tmp = node["tmp"]
    _run_other("mkdir", "-m", "0755", str(tmp / "areal-0"))  # /tmp's is taken
    runtime = tmp / "run-user-0"
    runtime.mkdir(mode=0o700)
    env = {**node["env"], "XDG_RUNTIME_DIR": str(runtime)}
    rank = Rank(env)
    node["started"].append(rank)
    path = rank.start()
    assert path == str(runtime / "areal" / "doctor" / f"{rank.pid}.sock")
    assert channel.ask(rank.pid, "ping")["pid"] == rank.pid
    # A runtime folder others may enter is not the user's private one: skipped.
    os.chmod(runtime, 0o755)
    assert channel.places(node["home"], 0, env)[-1] == tmp / "areal-0" / "doctor"


# -- 2. the client trusts only the job's user -----------------------------------------------


def test_root_doctor_never_takes_an_answer_from_a_socket_another_user_planted(node):
    rank = Rank(node["env"])
    node["started"].append(rank)
    planted = node["tmp"] / "areal-0" / "doctor"
    asked = _plant_server(node, planted, rank.pid)
    assert rank.start() is None  # /tmp/areal-0 is theirs: no channel

    assert channel.find(rank.pid) is None
    with pytest.raises(channel.ChannelError) as e:
        channel.ask(rank.pid, "progress")
    assert e.value.kind == "refused"
    assert f"belongs to uid {OTHER}, not to the job's user (uid 0)" in str(e.value)
    # Asked by path (a socket swapped in after the owner was checked): the kernel's word on
    # the peer refuses it before a request is sent.
    with pytest.raises(channel.ChannelError) as e:
        channel.ask_path(planted / f"{rank.pid}.sock", "progress")
    assert e.value.kind == "refused"
    assert f"served by uid {OTHER}" in str(e.value)
    assert asked.read_text() == ""  # the forgery was never asked anything


def test_a_forged_progress_does_not_hide_a_stall_from_the_watchdog(node):
    rank = Rank(node["env"])  # blocked reading its stdin: a stalled rank
    node["started"].append(rank)
    asked = _plant_server(node, node["tmp"] / "areal-0" / "doctor", rank.pid)
    rank.start()
    first = watchdog.look(rank.pid)
    second = watchdog.look(rank.pid)
    assert first[0] == second[0] == "movement"  # its own /proc, not the forged count
    assert not watchdog.moved(first, second)
    assert asked.read_text() == ""


def test_doctor_hang_never_judges_a_flight_recording_another_user_forged(node):
    rank = Rank(node["env"])
    node["started"].append(rank)
    asked = _plant_server(node, node["tmp"] / "areal-0" / "doctor", rank.pid)
    rank.start()
    res = subprocess.run(
        [AREAL, "doctor", "hang", "--pid", str(rank.pid), "--json"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert res.returncode in (0, 1), res.stderr
    assert "Traceback" not in res.stderr
    report = json.loads(res.stdout)
    assert report["verdict"] != "collective_stuck", report
    assert "forged_group" not in res.stdout
    assert asked.read_text() == ""


def test_a_socket_of_another_rank_is_not_taken_for_this_ones(node):
    # The peer's pid is checked too: a socket that leads to rank B does not answer for A.
    env = {**node["env"], "AREAL_HOME": str(node["tmp"] / "h")}
    a, b = Rank(env), Rank(env)
    node["started"] += [a, b]
    path_a, path_b = a.start(), b.start()
    os.unlink(path_a)
    os.link(path_b, path_a)
    with pytest.raises(channel.ChannelError) as e:
        channel.ask(a.pid, "ping")
    assert e.value.kind == "refused" and f"served by pid {b.pid}, not by pid {a.pid}" in str(
        e.value
    )
    assert channel.ask(b.pid, "ping")["pid"] == b.pid
