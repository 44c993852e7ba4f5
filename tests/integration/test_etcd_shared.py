"""An etcd registry shared with other users (no auth, so no owner on any key): what another
uid can do with our entries; what `areal stop` does while etcd does not answer, and on a
registry it cannot write."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from areal_cli import settings
from tests.helpers import AREAL, REPO, areal, fake_serve_args

SCRIPT = str(REPO / "tests" / "fixtures" / "scripts" / "record_env.py")
OTHER = 4242  # a uid no one uses here
ME = settings.user()
TRIAL = f"{ME}/default/trial0"

# Another user's HTTP server: answers 200 to everything and prints every request it gets,
# with its Authorization header, one JSON line each.
RECORDER = """
import http.server as h, json, sys
class H(h.BaseHTTPRequestHandler):
    def do_GET(self):
        print(json.dumps([self.command, self.path, self.headers.get("Authorization")]),
              flush=True)
        body = b'{"batching": {"paused": false}}'
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    do_POST = do_GET
    def log_message(self, *a): pass
s = h.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
print("port", s.server_address[1], flush=True)
s.serve_forever()
"""

# Another user writing keys into our tree over etcd's gateway: PUT key=value pairs (JSON on
# argv), no lease, so they never expire.
PUT = """
import base64, json, sys, urllib.request
b = lambda t: base64.b64encode(t.encode()).decode()
for key, value in json.loads(sys.argv[2]).items():
    req = urllib.request.Request(sys.argv[1] + "/v3/kv/put", method="POST",
                                 data=json.dumps({"key": b(key), "value": b(value)}).encode())
    urllib.request.urlopen(req, timeout=10).read()
"""


def needs_other_user():
    if shutil.which("setpriv") is None or os.getuid() != 0:
        pytest.skip("needs root and setpriv to act as another user")


def as_other(*argv: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        ["setpriv", f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups", *argv], **kw
    )


@pytest.fixture
def on_etcd(etcd, monkeypatch):
    monkeypatch.setenv("AREAL_REGISTRY", etcd.url)
    return etcd


@pytest.fixture
def model(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    return d


class Recorder:
    """The other user's server on `port` (0: any), and what it was sent."""

    def __init__(self, port: int = 0):
        self.proc = as_other(sys.executable, "-c", RECORDER, str(port), stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
        first = self.proc.stdout.readline().split()
        assert first[:1] == ["port"], first
        self.port = int(first[1])
        self.addr = f"127.0.0.1:{self.port}"
        self.requests: list[list] = []

    def close(self) -> list[list]:
        self.proc.kill()
        out = self.proc.communicate(timeout=10)[0]
        self.requests = [json.loads(x) for x in out.splitlines() if x.startswith("[")]
        return self.requests


def put_as_other(etcd, values: dict[str, str]) -> None:
    proc = as_other(sys.executable, "-c", PUT, etcd.endpoint, json.dumps(values))
    assert proc.wait(timeout=30) == 0


def serve(model) -> dict:
    out = json.loads(areal(*fake_serve_args(model, "--detach", "--json"), check=0).stdout)
    (server,) = out["servers"]
    return server


def test_a_copy_of_our_entry_pointing_at_another_users_server_never_gets_the_key(
    on_etcd, model, tmp_path
):
    needs_other_user()
    ours = serve(model)
    recorder = Recorder()
    try:
        sid = ours["addr"].replace(":", "_")
        meta = json.loads(on_etcd.get(f"{TRIAL}/areal/servers/{sid}"))
        assert meta["marker"] and meta["job"] and meta["api_key_required"]
        # Every field readable, marker and job included: copied under new ids at the other
        # user's server, once with our signature and once without one.
        unsigned = {**meta, "addr": recorder.addr, "signature": None}
        put_as_other(on_etcd, {
            f"{TRIAL}/areal/servers/copy1": json.dumps({**meta, "addr": recorder.addr}),
            f"{TRIAL}/gen_servers/copy1": recorder.addr,
            f"{TRIAL}/areal/servers/copy2": json.dumps(unsigned),
            f"{TRIAL}/gen_servers/copy2": recorder.addr,
        })  # fmt: skip
        rec = tmp_path / "rec"
        rec.mkdir()
        res = areal("train", "--alloc", "fsdp:d1", SCRIPT, env={"RECORD_DIR": str(rec)},
                    check=0, timeout=120)  # fmt: skip
        env = json.loads((rec / "rank-0.json").read_text())["env"]
        assert env["AREAL_LLM_SERVER_ADDRS"] == ours["addr"] and env["AREAL_API_KEY"]
        assert f"left out {recorder.addr}: its registry entry's signature does not match" in (
            res.stderr
        )
        assert res.stderr.count(f"left out {recorder.addr}") == 2
    finally:
        areal("stop", "default/trial0", check=0)
        sent = recorder.close()
    assert [r for r in sent if r[2]] == [], "the other user's server was sent a key"


def test_a_stopped_servers_entry_replayed_at_its_port_never_gets_the_key(on_etcd, model):
    needs_other_user()
    ttl = 2
    out = json.loads(areal(*fake_serve_args(model, "--detach", "--json"), check=0,
                           env={"AREAL_REGISTRY_TTL": str(ttl)}).stdout)  # fmt: skip
    (ours,) = out["servers"]
    snapshot = on_etcd.get_prefix(f"{TRIAL}/")
    assert len(snapshot) == 2
    areal("stop", "default/trial0", check=0)
    # The server is gone; another user takes its port and puts its last entries back (with
    # its own live pid, as the reader checks pids on this host), once their signature is
    # older than the TTL.
    recorder = Recorder(int(ours["addr"].rpartition(":")[2]))
    try:
        sid = ours["addr"].replace(":", "_")
        meta_key = f"{TRIAL}/areal/servers/{sid}"
        meta = {**json.loads(snapshot[meta_key]), "pid": recorder.proc.pid, "pid_create_time": None}
        time.sleep(ttl + 0.5)
        put_as_other(on_etcd, {**snapshot, meta_key: json.dumps(meta)})
        res = areal("train", "--alloc", "fsdp:d1", "--wait-servers", "1", SCRIPT, check=3,
                    timeout=60)  # fmt: skip
        assert f"left out {ours['addr']}: its registry entry was last signed" in res.stderr, (
            res.stderr
        )
    finally:
        sent = recorder.close()
    assert [r for r in sent if r[2]] == [], "the other user's server was sent a key"


# -- areal stop while etcd does not answer ---------------------------------------------------


@pytest.fixture
def own_etcd(etcd_factory, monkeypatch):
    server = etcd_factory()
    monkeypatch.setenv("AREAL_REGISTRY", server.url)
    yield server
    os.kill(server.pid, signal.SIGCONT)


def _train_in_background(tmp_path) -> subprocess.Popen:
    rec = tmp_path / "rec"
    rec.mkdir()
    env = {**os.environ, "RECORD_DIR": str(rec), "SLEEP": "1", "FAKE_REAL_PYTHON": sys.executable}
    proc = subprocess.Popen([AREAL, "train", "--alloc", "fsdp:d1", SCRIPT], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not (rec / "rank-0.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.1)
    return proc


@pytest.mark.parametrize("with_train", [True, False], ids=["train-and-serve", "serve-alone"])
def test_stop_with_etcd_stopped_stops_every_process_and_names_the_entries_left(
    own_etcd, model, tmp_path, with_train
):
    serve(model)
    train = _train_in_background(tmp_path) if with_train else None
    try:
        os.kill(own_etcd.pid, signal.SIGSTOP)  # accepts connections, answers nothing
        t0 = time.monotonic()
        res = areal("stop", "default/trial0", check=0, timeout=120)
        took = time.monotonic() - t0
        jobs = 2 if with_train else 1
        assert res.stdout.count("default/trial0 stopped (") == jobs, res.stdout + res.stderr
        assert (
            res.stderr.count(
                f"left default/trial0: the job's registry entries in {own_etcd.url} were not removed"
            )
            == jobs
            and "etcd drops them when their lease runs out" in res.stderr
        )
        if train is not None:
            assert train.wait(timeout=10) == 143
        # Bounded: each job's own stop, plus one request timeout (5 s) for the registry (with
        # room for a loaded machine: 16 s and 9 s measured on two busy cores).
        assert took < (30 if with_train else 20), f"took {took:.1f}s"
        print(f"\nstop with etcd stopped ({'train and serve' if with_train else 'serve'}): "
              f"{took:.1f}s")  # fmt: skip
    finally:
        os.kill(own_etcd.pid, signal.SIGCONT)
        if train is not None and train.poll() is None:
            train.kill()
            train.wait()
        areal("stop", "default/trial0", timeout=120)


def test_stop_on_a_read_only_registry_says_no_entry_was_removed(model, tmp_path, monkeypatch):
    if os.getuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a read-only registry")
    src, reg = tmp_path / "reg-src", tmp_path / "reg"
    src.mkdir()
    reg.mkdir()
    subprocess.run(["mount", "--bind", str(src), str(reg)], check=True)
    monkeypatch.setenv("AREAL_REGISTRY", str(reg))
    try:
        serve(model)
        subprocess.run(["mount", "-o", "remount,ro,bind", str(reg)], check=True)
        res = areal("stop", "default/trial0", check=0)
        assert (
            "default/trial0 stopped (0 leftover process(es) killed, 0 registry entries removed)"
            in (res.stdout)
        ), res.stdout
        assert f"1 registry entry left in {reg} (Read-only file system)" in res.stderr, res.stderr
        assert "readers skip such entries: their servers are gone" in res.stderr
        assert len(list((reg / ME / "default" / "trial0" / "gen_servers").iterdir())) == 1
    finally:
        areal("stop", "default/trial0")
        subprocess.run(["umount", "-l", str(reg)], check=False)


def test_a_slurm_jobs_end_names_the_entries_an_unreachable_registry_kept(tmp_path):
    from areal_cli.schedulers.slurm import job, records

    with socket.socket() as s:  # a port nothing listens on: etcd refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"etcd://127.0.0.1:{port}?connect_timeout=0.5&timeout=0.5"
    rec = records.SlurmRecord(
        experiment="default", trial="trial0", kind="serve", job_id="7", marker="areal-x",
        state="stopped", submitted=time.time(), log_dir=str(tmp_path), registry=url,
        run_dir=str(tmp_path),
    )  # fmt: skip
    left: list[str] = []
    assert job.finish(rec, tmp_path / "home", None, left) == 0
    (why,) = left
    assert why.startswith(f"the job's registry entries in {url} were not removed (etcd at")
