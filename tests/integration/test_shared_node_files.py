"""A shared node, the files' side: another local user (uid 4242, a real other uid via setpriv)
plants links, FIFOs and records where root's `areal` writes or reads (AREAL_HOME, its log
folders, a key file's place), with umask 000 where that matters. Nothing is written through
their links, nothing they wrote is acted on, and what areal keeps is private."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from areal_cli import apikeys, settings
from tests.helpers import AREAL, areal, fake_serve_args, fill, small_tmpfs, wait_for

OTHER = 4242  # a uid no one uses here
ME = settings.user()
WATCHDOG_JOB = str(Path(__file__).resolve().parents[1] / "fixtures" / "scripts" / "watchdog_job.py")

pytestmark = pytest.mark.skipif(
    os.getuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to act as another user",
)


def as_other(script: str, *args: str) -> subprocess.CompletedProcess:
    """`sh -c script args...` as uid 4242, under umask 000."""
    argv = ["setpriv", f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups"]
    argv += ["sh", "-c", f"umask 000; {script}", "sh", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


def areal_umask0(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    """`areal ARGS` run by root under umask 000."""
    full = {**os.environ, "FAKE_REAL_PYTHON": sys.executable, "COLUMNS": "200", **env}
    return subprocess.run(
        ["sh", "-c", 'umask 000; exec "$0" "$@"', AREAL, *args],
        capture_output=True, text=True, timeout=timeout, env=full,
    )  # fmt: skip


@pytest.fixture
def shared():
    """A folder every user can reach (0755, root's), as a node's /tmp/x or /scratch is."""
    base = Path(tempfile.mkdtemp(prefix="areal-files-", dir="/tmp"))
    os.chmod(base, 0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def root_secret(shared):
    """A file only root may read or write, in a folder only root may enter."""
    d = shared / "root-only"
    d.mkdir(mode=0o700)
    f = d / "secret"
    f.write_text("root's own\n")
    os.chmod(f, 0o600)
    return f


def _modes(root: Path) -> dict[str, str]:
    return {str(p): oct(stat.S_IMODE(p.lstat().st_mode)) for p in [root, *root.rglob("*")]}


# -- areal key --file ----------------------------------------------------------------------


@pytest.fixture
def keyed(shared):
    """A home holding the API key of job e/t, and a sticky folder (as /tmp) another user
    shares with root."""
    home = shared / "home"
    apikeys.store(apikeys.key_file(home, "e", "t"), "marker", "sekret-4711")
    drop = shared / "drop"
    drop.mkdir()
    os.chmod(drop, 0o1777)
    return home, drop


def test_key_file_never_replaces_a_link_a_fifo_or_a_folder(keyed, root_secret):
    home, drop = keyed
    env = {"AREAL_HOME": str(home)}
    planted = as_other(
        'ln -s "$1" "$2/to-secret" && ln -s /dev/null "$2/to-null" && mkfifo "$2/fifo" '
        '&& mkdir "$2/folder"',
        str(root_secret), str(drop),
    )  # fmt: skip
    assert planted.returncode == 0, planted.stderr
    for name, what in [("to-secret", "symlink"), ("to-null", "symlink"), ("fifo", "regular"),
                       ("folder", "folder")]:  # fmt: skip
        target = drop / name
        before = target.lstat()
        res = areal("key", "e/t", "--file", str(target), env=env, check=2)
        assert str(target) in res.stderr and what in res.stderr, res.stderr
        assert "Traceback" not in res.stderr and "sekret" not in res.stdout + res.stderr
        after = target.lstat()
        assert (after.st_ino, after.st_mode, after.st_uid) == (
            before.st_ino, before.st_mode, before.st_uid,
        )  # fmt: skip
    assert root_secret.read_text() == "root's own\n"
    assert [p.name for p in drop.iterdir() if p.name.startswith(".")] == []  # no temp file left
    # `-` (and no --file) prints; a file of one's own is written 0600.
    assert areal("key", "e/t", "--file", "-", env=env, check=0).stdout == "sekret-4711\n"
    assert areal("key", "e/t", env=env, check=0).stdout == "sekret-4711\n"
    mine = drop / "mine.key"
    areal_umask0("key", "e/t", "--file", str(mine), env=env)
    assert mine.read_text() == "sekret-4711\n" and stat.S_IMODE(mine.stat().st_mode) == 0o600


@pytest.mark.parametrize("value", ["", "/", "."])
def test_key_file_that_names_no_file_exits_2(keyed, value):
    res = areal("key", "e/t", "--file", value, env={"AREAL_HOME": str(keyed[0])}, check=2)
    assert "Traceback" not in res.stderr and "sekret" not in res.stdout


def test_key_file_and_env_file_naming_one_file_exit_2(keyed):
    home, drop = keyed
    f = drop / "both"
    res = areal("key", "e/t", "--file", str(f), "--env-file", "both", cwd=drop,
                env={"AREAL_HOME": str(home)}, check=2)  # fmt: skip
    assert "--file and --env-file both name" in res.stderr, res.stderr
    assert not f.exists()


# -- records, logs and run/ under umask 000 ------------------------------------------------


def test_umask_000_still_makes_everything_private(shared, tmp_path):
    home = shared / "home"
    model = tmp_path / "model"
    model.mkdir()
    env = {"AREAL_HOME": str(home), "AREAL_REGISTRY": str(tmp_path / "registry")}
    res = areal_umask0(*fake_serve_args(model, "--detach", "--trial", "u0"), env=env)
    assert res.returncode == 0, res.stderr
    try:
        modes = _modes(home)
        folders = {p: m for p, m in modes.items() if Path(p).is_dir()}
        assert set(folders.values()) == {oct(0o700)}, folders
        open_files = {p: m for p, m in modes.items() if int(m, 8) & 0o022}
        assert open_files == {}, open_files
        record = next(home.glob("jobs/*/default/u0/serve.json"))
        logs = next(home.glob("logs/*/default/u0"))
        # The other user can neither rewrite the record nor plant a link among the logs.
        tried = as_other('echo "{}" > "$1"; ln -s /etc/passwd "$2/watchdog.log"',
                         str(record), str(logs))  # fmt: skip
        assert tried.stderr.count("Permission denied") == 2, tried.stderr
        assert json.loads(record.read_text())["trial"] == "u0"
    finally:
        areal("stop", "default/u0", env=env, check=0)


@pytest.fixture
def left_open(shared):
    """A home where an older areal, run under umask 000, left a trial's folders 0777 (from
    `<home>/<kind>` down)."""
    home = shared / "home"

    def make(kind: str, trial: str) -> Path:
        d = home / kind / ME / "default" / trial
        d.mkdir(parents=True, exist_ok=True)
        for p in [d, *d.parents]:
            if p == home:
                break
            os.chmod(p, 0o777)
        return d

    return home, make


def test_records_another_user_wrote_are_never_acted_on(left_open):
    home, make = left_open
    victim = subprocess.Popen(["sleep", "300"])
    try:
        ct = psutil.Process(victim.pid).create_time()
        forged = {
            "experiment": "default", "trial": "forged", "kind": "train", "state": "running",
            "marker": "forged", "supervisor_pid": victim.pid, "supervisor_create_time": ct,
            "host": settings.hostname(), "started": time.time(), "log_dir": "/nonexistent",
            "registry": "/nonexistent", "processes": [
                {"role": "trainer", "index": 0, "pid": victim.pid, "argv": ["sleep"],
                 "log": "/nonexistent", "create_time": ct}],
        }  # fmt: skip
        d = make("jobs", "forged")
        wrote = as_other('printf %s "$1" > "$2/train.json"', json.dumps(forged), str(d))
        assert wrote.returncode == 0 and (d / "train.json").stat().st_uid == OTHER
        # Root's own record, left writable by everyone: as good as anyone's.
        d2 = make("jobs", "open")
        (d2 / "train.json").write_text(json.dumps({**forged, "trial": "open"}))
        os.chmod(d2 / "train.json", 0o666)
        env = {"AREAL_HOME": str(home)}
        ps = areal("ps", "--all", "--json", env=env)
        assert ps.returncode == 0, ps.stderr
        assert json.loads(ps.stdout) == [], ps.stdout
        assert f"belongs to uid {OTHER}" in ps.stderr and "group or others can write" in ps.stderr
        for trial in ("forged", "open"):
            res = areal("stop", f"default/{trial}", env=env)
            assert res.returncode == 2 and "warning" in res.stderr, res.stderr
            assert "Traceback" not in res.stderr
        assert victim.poll() is None, "areal stop killed a process named by a foreign record"
    finally:
        victim.kill()
        victim.wait()


def test_a_log_folder_others_can_write_is_refused_and_their_links_never_followed(
    left_open, root_secret
):
    """The other user plants `watchdog.log` and every `watchdog-<time>` of the next minutes
    as links to root's files; root's stalled job must write through none of them."""
    home, make = left_open
    logs = make("logs", "planted")
    target_dir = root_secret.parent
    plant = (
        'ln -s "$1" "$2/watchdog.log"; now=$(date +%s); i=0; while [ $i -lt 240 ]; do '
        'ln -s "$3" "$2/watchdog-$(date -d @$((now+i)) +%Y%m%d-%H%M%S)"; i=$((i+1)); done'
    )
    planted = as_other(plant, str(root_secret), str(logs), str(target_dir))
    assert planted.returncode == 0, planted.stderr
    res = areal("train", "--alloc", "fsdp:d2", "--servers", "none", "--trial", "planted",
                "--watchdog", "2", "--watchdog-action", "fail", WATCHDOG_JOB,
                env={"AREAL_HOME": str(home), "STALL_RANK": "1"}, timeout=120)  # fmt: skip
    assert res.returncode == 2, res.stderr[-3000:]
    assert str(logs) in res.stderr and "chmod go-w" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert root_secret.read_text() == "root's own\n"
    assert sorted(p.name for p in target_dir.iterdir()) == ["secret"]


# -- the watchdog's bundle -----------------------------------------------------------------


def _stalled_job(home: Path, trial: str, seconds: str, env: dict | None = None):
    argv = [AREAL, "train", "--alloc", "fsdp:d2", "--servers", "none", "--trial", trial,
            "--watchdog", seconds, "--watchdog-action", "fail", WATCHDOG_JOB]  # fmt: skip
    full = {**os.environ, "COLUMNS": "200", "FAKE_REAL_PYTHON": sys.executable,
            "AREAL_HOME": str(home), "STALL_RANK": "1", **(env or {})}  # fmt: skip
    return subprocess.Popen(argv, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip


def _end(p: subprocess.Popen, timeout: float) -> tuple[str, str]:
    try:
        return p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGINT)
        out = p.communicate(timeout=60)
        pytest.fail(f"the job did not end: {out[1][-3000:]}")


def test_a_bundle_is_private_under_the_default_umask(shared):
    home = shared / "home"
    home.mkdir(mode=0o755)  # a home others may enter: the bundle itself must keep them out
    out, err = _end(_stalled_job(home, "private", "2"), 180)
    (rec,) = home.glob("jobs/*/default/private/train.json")
    stall = json.loads(rec.read_text())["watchdog"]
    bundle = Path(stall["bundle"])
    tail = bundle / "logs" / "rank-1.tail.log"
    assert "skips the all_reduce" in tail.read_text()
    modes = _modes(bundle)
    assert {m for p, m in modes.items() if Path(p).is_dir()} == {oct(0o700)}, modes
    assert {m for p, m in modes.items() if not Path(p).is_dir()} == {oct(0o600)}, modes
    read = as_other('cat "$1"', str(tail))
    assert read.returncode != 0 and "skips" not in read.stdout, read


@pytest.fixture
def small_fs(tmp_path):
    with small_tmpfs(tmp_path / "small", "4m") as mnt:
        yield mnt


def test_a_full_disk_neither_kills_the_watchdog_nor_its_action(small_fs):
    """The disk fills while rank 1 hangs: no bundle can be written, yet the verdict is said
    and --watchdog-action fail ends the job (before, the watchdog thread died and the job
    hung on)."""
    home = small_fs / "home"
    p = _stalled_job(home, "full", "10")
    try:
        rank1 = wait_for(lambda: next(home.glob("logs/*/default/full/rank-1.log"), None), 90,
                         "no rank-1.log")  # fmt: skip
        wait_for(lambda: "skips the all_reduce" in rank1.read_text(), 90, "rank 1 never hung")
        fill(small_fs)
    except BaseException:
        os.killpg(p.pid, signal.SIGINT)
        p.communicate(timeout=60)
        raise
    out, err = _end(p, 120)
    assert p.returncode == 1, err[-3000:]
    assert "mismatched_collective" in err, err[-3000:]
    assert f"no space left on tmpfs at {small_fs}" in err, err[-3000:]
    assert "Traceback" not in err and "OSError" not in err, err[-3000:]
