"""A shared GPU node: another local user (a real other uid, via setpriv), two starts at once,
a suspended supervisor, a stop with nothing alive, stops from outside, hostile inputs."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from areal_cli import apikeys, settings
from areal_cli.registry import FileRegistry, ServerEntry
from tests.helpers import AREAL, REPO, areal, fake_serve_args

SCRIPT = str(REPO / "tests" / "fixtures" / "scripts" / "record_env.py")
OTHER = 4242  # a uid no one uses here
ME = settings.user()


def _wait(pred, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def as_other(*argv: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        ["setpriv", f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups", *argv], **kw
    )


@pytest.fixture
def model(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    return d


@pytest.fixture(scope="module")
def tiny():
    """A real tiny model in a folder every user may read (the other uid serves it too)."""
    from areal_cli.modelgen import create_tiny_model

    base = Path(tempfile.mkdtemp(prefix="areal-tiny-", dir="/tmp"))
    made = create_tiny_model(base / "tiny", seed=0)
    for p in [base, *base.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    yield made
    shutil.rmtree(base, ignore_errors=True)


def needs_other_user():
    if shutil.which("setpriv") is None or os.getuid() != 0:
        pytest.skip("needs root and setpriv to act as another user")


@pytest.fixture
def shared_root(monkeypatch):
    """A registry root another uid can reach, as /tmp/areal is."""
    if shutil.which("setpriv") is None or os.getuid() != 0:
        pytest.skip("needs root and setpriv to act as another user")
    base = Path(tempfile.mkdtemp(prefix="areal-shared-", dir="/tmp"))
    os.chmod(base, 0o755)
    root = base / "name_resolve"
    root.mkdir()
    os.chmod(root, 0o1777)
    monkeypatch.setenv("AREAL_REGISTRY", str(root))
    yield root
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def other_server():
    """An HTTP server of another user that answers 200 on /health and records requests."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "import http.server as h\n"
        "class H(h.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n"
        "    do_POST = do_GET\n"
        "    def log_message(self, *a): pass\n"
        f"h.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n"
    )
    proc = as_other(sys.executable, "-c", code)
    try:
        assert _wait(lambda: _answers(port), 20)
        yield port
    finally:
        proc.kill()
        proc.wait()


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


# -- 1. planted servers --------------------------------------------------------------------


def test_entries_another_user_planted_are_never_used(shared_root, other_server, tmp_path):
    # The other user gets there first and makes "our" folder, with an entry of their server.
    plant = (
        "import os, sys\n"
        "d = os.path.join(sys.argv[1], sys.argv[2], 'default', 'trial0', 'gen_servers', 'x')\n"
        "os.makedirs(d)\n"
        "open(os.path.join(d, 'ENTRY'), 'w').write('127.0.0.1:' + sys.argv[3])\n"
    )
    as_other(sys.executable, "-c", plant, str(shared_root), ME, str(other_server)).wait()
    assert (shared_root / ME).stat().st_uid == OTHER
    listing = FileRegistry(shared_root).list()
    assert listing.servers == [] and "untrusted" in listing.skipped[0][1]
    res = areal("train", "--alloc", "fsdp:d1", "--wait-servers", "1", SCRIPT, check=3)
    assert f"127.0.0.1:{other_server}" not in res.stderr.split("searched")[0]
    # Serving refuses to write into a folder another user made (and names it).
    res = areal(*fake_serve_args(tmp_path, "--detach"), check=2)
    assert "not yours" in res.stderr and str(shared_root / ME) in res.stderr


def test_our_folder_is_private_so_nothing_can_be_planted(shared_root, model):
    out = json.loads(areal(*fake_serve_args(model, "--detach", "--json"), check=0).stdout)
    try:
        assert oct((shared_root / ME).stat().st_mode & 0o777) == oct(0o700)
        plant = "import os,sys; os.makedirs(os.path.join(sys.argv[1], 'default', 'x'))"
        proc = as_other(sys.executable, "-c", plant, str(shared_root / ME), stderr=subprocess.PIPE)
        assert proc.wait() != 0 and b"Permission denied" in proc.stderr.read()
        assert [e.addr for e in FileRegistry(shared_root).list().servers] == [
            s["addr"] for s in out["servers"]
        ]
    finally:
        areal("stop", "default/trial0", check=0)


def test_the_key_goes_only_to_servers_its_job_started(model, areal_env, tmp_path):
    home, reg = areal_env
    out = json.loads(
        areal(*fake_serve_args(model, "--host", "0.0.0.0", "--detach", "--json"), check=0).stdout
    )
    try:
        # An entry without our metadata (as AReaL writes them) beside our keyed servers.
        d = reg / ME / "default" / "trial0" / "gen_servers" / "stranger"
        d.mkdir()
        (d / "ENTRY").write_text("127.0.0.1:9")
        rec = tmp_path / "rec"
        rec.mkdir()
        res = areal("train", "--alloc", "fsdp:d1", SCRIPT, env={"RECORD_DIR": str(rec)},
                    check=0, timeout=120)  # fmt: skip
        assert "left out" in res.stderr and "not started by the job" in res.stderr
        env = json.loads((rec / "rank-0.json").read_text())["env"]
        assert env["AREAL_LLM_SERVER_ADDRS"] == out["servers"][0]["addr"]
        assert env["AREAL_API_KEY"]
    finally:
        areal("stop", "default/trial0", check=0)


# -- 2. the key in ps, 3. open loopback servers ----------------------------------------------

# Run as the other user: what it sees of our server and what the server lets it do.
PROBE = """
import json, os, sys, urllib.request, urllib.error
pid, addr, key = sys.argv[1], sys.argv[2], os.environ["OUR_KEY"]
out = {"cmdline_has_key": key in open(f"/proc/{pid}/cmdline").read()}
try:
    open(f"/proc/{pid}/environ").read()
    out["environ"] = "read"
except PermissionError:
    out["environ"] = "denied"
for method, path in [("GET", "/health"), ("POST", "/generate"), ("POST", "/pause_generation"),
                     ("POST", "/update_weights_from_disk"), ("POST", "/continue_generation"),
                     ("GET", "/model_info")]:
    req = urllib.request.Request(f"http://{addr}{path}", method=method,
                                 data=b"{}" if method == "POST" else None)
    try:
        out[path] = urllib.request.urlopen(req, timeout=30).status
    except urllib.error.HTTPError as e:
        out[path] = e.code
print(json.dumps(out))
"""


def test_no_process_shows_the_key_and_another_user_gets_401(tiny, areal_env):
    needs_other_user()
    home, _ = areal_env
    # Loopback and `--api-key auto` (the default): a key all the same.
    out = json.loads(areal("serve", "--backend", "hf", "--model", str(tiny), "--detach", "--json",
                           check=0, timeout=180).stdout)  # fmt: skip
    try:
        (server,) = out["servers"]
        key = json.loads(apikeys.key_file(home, "default", "trial0").read_text())["key"]
        seen = {}
        for p in psutil.process_iter():
            try:
                seen[p.pid] = "\0".join(p.cmdline())
            except psutil.Error:
                continue
        assert "areal_cli.server" in seen[server["pid"]]
        assert [pid for pid, cmd in seen.items() if key in cmd] == []
        env = {**os.environ, "OUR_KEY": key}
        probe = as_other(sys.executable, "-c", PROBE, str(server["pid"]), server["addr"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        got = json.loads(probe.communicate(timeout=120)[0])
        assert got.pop("cmdline_has_key") is False and got.pop("environ") == "denied"
        assert got.pop("/health") == 200 and set(got.values()) == {401}, got
        # With the key it serves.
        req = urllib.request.Request(
            f"http://{server['addr']}/generate",
            json.dumps({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}).encode(),
            {"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200 and len(json.loads(r.read())["output_ids"]) == 2
    finally:
        areal("stop", "default/trial0", check=0)


@pytest.mark.parametrize("backend, var", [("sglang", "AREAL_SERVER_API_KEY"),
                                          ("vllm", "VLLM_API_KEY")])  # fmt: skip
def test_sglang_and_vllm_get_the_key_in_their_environment_only(model, backend, var):
    env = {"PATH": f"{REPO / 'tests' / 'fixtures'}:{os.environ['PATH']}"}  # nvidia-smi: GPUs
    args = ["serve", "--backend", backend, "--model", str(model), "--alloc", f"{backend}:d1",
            "--api-key", "sekret-4242", "--dry-run"]  # fmt: skip
    text = areal(*args, env=env, check=0).stdout
    plan = json.loads(areal(*args, "--json", env=env, check=0).stdout)
    assert "sekret-4242" not in text + json.dumps(plan)
    (proc,) = plan["processes"]
    assert proc["env"][var] == "<api-key>" and f"{var}='<api-key>'" in text
    assert "--api-key" not in proc["argv"] and "<api-key>" not in proc["argv"]
    if backend == "sglang":
        # srt/server_args.py:400-405: the key goes in a --config YAML, fed by our launcher.
        cut = proc["argv"].index("--")
        assert proc["argv"][1:cut] == ["-m", "areal_cli.backends.sglang_launch"]
        assert proc["argv"][cut + 2 : cut + 4] == ["-m", "sglang.launch_server"]


# A stand-in for `python -m sglang.launch_server`: it parses its command line the way SGLang
# 0.5.23's prepare_server_args does (srt/server_args.py:683-689), with SGLang's own
# ConfigArgumentMerger (srt/utils/server_args_config_parser.py) when the wheel is unpacked.
FAKE_SGLANG = """
import argparse, importlib.util, json, os, sys
from pathlib import Path
parser = argparse.ArgumentParser()
for flag in ("--model-path", "--api-key", "--config", "--tp-size"):
    parser.add_argument(flag)
argv = sys.argv[1:]
source = Path("/tmp/wheels/sglang/sglang/srt/utils/server_args_config_parser.py")
if source.exists():
    spec = importlib.util.spec_from_file_location("parser", source)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    argv = mod.ConfigArgumentMerger(parser).merge_config_with_args(argv)
else:
    import yaml
    i = argv.index("--config")
    path = Path(argv[i + 1])
    assert path.suffix == ".yaml" and path.exists()
    extra = [x for k, v in yaml.safe_load(path.open()).items() for x in ("--" + k, str(v))]
    argv = extra + argv[:i] + argv[i + 2:]
args = parser.parse_args(argv)
print(json.dumps({"pid": os.getpid(), "cmdline": open("/proc/self/cmdline").read(),
                  "api_key": args.api_key, "tp_size": args.tp_size, "config": sys.argv[-1],
                  "env_key": os.environ.get("AREAL_SERVER_API_KEY")}))
"""


def test_sglang_reads_its_key_from_a_fifo_that_is_gone_after(tmp_path):
    fake = tmp_path / "fake_sglang.py"
    fake.write_text(FAKE_SGLANG)
    user = tmp_path / "mine.yaml"
    user.write_text("tp-size: 2\n")  # the user's own --config is merged, not lost
    cmd = [sys.executable, "-m", "areal_cli.backends.sglang_launch", "--", sys.executable,
           str(fake), "--model-path", "/m", "--config", str(user)]  # fmt: skip
    env = {**os.environ, "AREAL_SERVER_API_KEY": "k-fifo-1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["api_key"] == "k-fifo-1" and got["tp_size"] == "2"
    assert "k-fifo-1" not in got["cmdline"] and got["env_key"] is None
    assert _wait(lambda: not os.path.exists(got["config"]), 5)  # read once, then removed
    assert not os.path.exists(os.path.dirname(got["config"]))


# An hf server run by the other user: no path's answer says more than any other's.
def test_disk_update_errors_do_not_tell_paths_apart(tiny, tmp_path):
    needs_other_user()
    base = Path(tempfile.mkdtemp(prefix="areal-paths-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)
        hidden = base / "hidden"  # a real checkpoint the server's user may not read
        shutil.copytree(tiny, hidden / "ckpt")
        os.chmod(hidden, 0o700)
        (base / "file").write_text("x")
        (base / "empty").mkdir()
        (base / "junk").mkdir()
        (base / "junk" / "config.json").write_text("{not json")
        from areal_cli.modelgen import create_tiny_model

        wide = create_tiny_model(base / "wide", seed=0, hidden_size=32)
        for p in [base, *base.rglob("*")]:
            if hidden not in (p, *p.parents):
                os.chmod(p, 0o755 if p.is_dir() else 0o644)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "HOME": str(base), "HF_HUB_OFFLINE": "1",
               "AREAL_SERVER_API_KEY": "k"}  # fmt: skip
        log = (base / "server.log").open("w")
        server = as_other(sys.executable, "-m", "areal_cli.server", "--model-path", str(tiny),
                          "--port", str(port), env=env, stdout=log,
                          stderr=subprocess.STDOUT)  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            up = _wait(lambda: server.poll() is not None or _status(url + "/health") == 200, 120)
            assert up and server.poll() is None, (base / "server.log").read_text()
            answers = {}
            for name, path in [("missing", base / "nope"), ("unreadable", hidden / "ckpt"),
                               ("a file", base / "file"), ("empty", base / "empty"),
                               ("not a checkpoint", base / "junk"), ("another model", wide)]:  # fmt: skip
                answers[name] = _post(url + "/update_weights_from_disk", {"model_path": str(path)})
            assert len({json.dumps(a) for a in answers.values()}) == 1, answers
            status, body = answers["missing"]
            assert status == 400 and body["success"] is False and str(base) not in body["message"]
        finally:
            server.kill()
            server.wait()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": "Bearer k",
                                          "Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_doctor_check_says_how_keys_travel_and_warns_of_sglangs_open_logs(tmp_path):
    # SGLang installed (its metadata is all `doctor check` reads), logs others may enter.
    site = tmp_path / "site"
    (site / "sglang-0.5.23.dist-info").mkdir(parents=True)
    (site / "sglang-0.5.23.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.23\n"
    )
    home = Path(tempfile.mkdtemp(prefix="areal-home-", dir="/tmp"))
    try:
        os.chmod(home, 0o755)
        logs = home / "logs" / ME
        logs.mkdir(parents=True)
        env = {"PYTHONPATH": str(site), "AREAL_HOME": str(home)}

        def row() -> dict:
            res = areal("doctor", "check", "--json", env=env)
            return next(r for r in json.loads(res.stdout)["rows"] if r["name"] == "server API keys")

        got = row()
        assert got["status"] == "warn" and f"chmod 700 {logs}" in got["fix"]
        assert "VLLM_API_KEY" in got["detail"] and "--config" in got["detail"]
        os.chmod(logs, 0o700)
        assert row()["status"] == "pass"
    finally:
        shutil.rmtree(home, ignore_errors=True)


# -- 6. two starts at once -----------------------------------------------------------------


def test_two_starts_at_once_one_runs_the_other_is_refused_at_once(model):
    env = {**os.environ, "FAKE_REAL_PYTHON": sys.executable, "COLUMNS": "200"}
    argv = [AREAL, *fake_serve_args(model, "--alloc", "hf:d2", "--detach")]
    procs_ = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True) for _ in range(2)]  # fmt: skip
    t0 = time.monotonic()
    try:
        # The first to finish is the refused one, at once (the other waits for its servers).
        assert _wait(lambda: any(p.poll() is not None for p in procs_), 20)
        first_done = time.monotonic() - t0
        outs = [p.communicate(timeout=120) for p in procs_]
        codes = sorted(p.returncode for p in procs_)
        assert codes == [0, 2], outs
        refused = next(o for p, o in zip(procs_, outs, strict=True) if p.returncode == 2)
        # Named by the pid holding the trial's slot, or by the job record once it exists.
        assert re.search(
            r"(starting or running \(pid \d+|already running \(serve, supervisor pid \d+)",
            refused[1],
        )
        assert "Traceback" not in refused[1] and first_done < 10
        (job,) = json.loads(areal("ps", "--json", check=0).stdout)
        assert job["state"] == "running" and all(s["healthy"] for s in job["servers"])
    finally:
        areal("stop", "default/trial0", check=0)


# -- 7. a suspended supervisor -------------------------------------------------------------


def test_a_stopped_supervisor_neither_drops_nor_freezes_its_servers(model, areal_env):
    home, reg = areal_env
    env = {**os.environ, "FAKE_REAL_PYTHON": sys.executable, "AREAL_REGISTRY_TTL": "2",
           "FAKE_SERVER_CHATTY": str(1 << 20), "FAKE_SERVER_CHATTY_DELAY": "1"}  # fmt: skip
    fg = subprocess.Popen([AREAL, *fake_serve_args(model)], env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        assert _wait(lambda: len(FileRegistry(reg).list().servers) == 1, 60)
        fg.send_signal(signal.SIGSTOP)  # what Ctrl-Z does to a foreground job
        time.sleep(5)  # more than twice the TTL; the server logs 1 MiB meanwhile
        (entry,) = FileRegistry(reg).list().servers
        host, port = entry.addr.rsplit(":", 1)
        assert _answers(int(port))
        res = areal("train", "--alloc", "fsdp:d1", "--wait-servers", "5", "--dry-run", "--json",
                    SCRIPT, check=0)  # fmt: skip
        tr = json.loads(res.stdout)["processes"][0]
        assert tr["env"]["AREAL_LLM_SERVER_ADDRS"] == entry.addr
        log = next((home / "logs").rglob("server-0.log"))
        assert log.stat().st_size > 1 << 20  # 16 pipe buffers past a suspended reader
    finally:
        fg.send_signal(signal.SIGCONT)
        fg.send_signal(signal.SIGINT)
        fg.wait(120)


# -- 8. stop with nothing alive ------------------------------------------------------------


def test_stop_with_nothing_alive_cleans_every_kinds_leftovers(model, areal_env, tmp_path):
    home, reg = areal_env
    out = json.loads(areal(*fake_serve_args(model, "--detach", "--json"), check=0).stdout)
    server_pid = out["servers"][0]["pid"]
    areal("train", "--alloc", "fsdp:d1", "--servers", "none", SCRIPT,
          env={"RECORD_DIR": str(tmp_path)}, check=0, timeout=120)  # fmt: skip
    # The serving job's supervisor and its watchdog die without a word (a kill -9 of both).
    (rec,) = home.glob("jobs/*/default/trial0/serve.json")
    marker = json.loads(rec.read_text())["marker"]
    sup = psutil.Process(json.loads(rec.read_text())["supervisor_pid"])
    watchdogs = [p for p in psutil.process_iter(["cmdline"])
                 if p.info["cmdline"] and marker in p.info["cmdline"] and p.pid != sup.pid]  # fmt: skip
    for p in [sup, *watchdogs]:
        p.kill()
    psutil.wait_procs([sup, *watchdogs], timeout=5)
    assert psutil.pid_exists(server_pid) and FileRegistry(reg).list(include_dead=True).servers
    res = areal("stop", "default/trial0", "--json", check=0)
    assert {r["name"] for r in json.loads(res.stdout)} == {"default/trial0"}
    assert _wait(lambda: not psutil.pid_exists(server_pid), 10)
    assert FileRegistry(reg).list(include_dead=True).servers == []


# -- 10. stopped is not success ------------------------------------------------------------


@pytest.mark.parametrize("how, code", [("SIGTERM", 143), ("SIGINT", 130), ("areal stop", 143)])
def test_training_stopped_from_outside_exits_non_zero_without_a_traceback(tmp_path, how, code):
    env = {**os.environ, "RECORD_DIR": str(tmp_path), "SLEEP": "1", "COLUMNS": "200"}
    fg = subprocess.Popen([AREAL, "train", "--alloc", "fsdp:d1", "--servers", "none", SCRIPT],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert _wait(lambda: len(list(tmp_path.glob("rank-*.json"))) == 1, 120)
        if how == "areal stop":
            areal("stop", "default/trial0", check=0)
        else:
            fg.send_signal(getattr(signal, how))
        _, err = fg.communicate(timeout=60)
        assert fg.returncode == code, err
        assert "SignalException" not in err and "Traceback" not in err
    finally:
        if fg.poll() is None:
            fg.kill()
            fg.wait()
    (job,) = json.loads(areal("ps", "--all", "--json", check=0).stdout)
    assert job["state"] == "stopped" and job["exit_code"] == code


# -- 12. discovery honours its deadline ----------------------------------------------------


def test_waiting_for_servers_over_800_silent_entries_keeps_its_deadline(areal_env):
    home, reg = areal_env
    silent = socket.socket()
    silent.bind(("0.0.0.0", 0))
    silent.listen(1024)  # accepts connections, never answers a request
    port = silent.getsockname()[1]
    try:
        r = FileRegistry(reg)
        for i in range(800):
            addr = f"127.0.{i // 250}.{i % 250 + 2}:{port}"
            r._put(f"{ME}/default/trial0/gen_servers/s{i}", addr)
        # Two entries of one address count once.
        r._put(f"{ME}/default/trial0/gen_servers/dup", f"127.0.0.2:{port}")
        t0 = time.monotonic()
        res = areal("train", "--alloc", "fsdp:d1", "--wait-servers", "2", SCRIPT, check=3)
        took = time.monotonic() - t0
        # The deadline (2 s) plus the command's own start and exit, which take several seconds
        # at a load of 15; probing the 800 entries one after another would take minutes.
        assert took < 2 + 10, took
        assert "after waiting 2s" in res.stderr
    finally:
        silent.close()


# -- 9. GPUs other users hold ---------------------------------------------------------------


def test_gpus_of_other_users_and_of_any_gpu_process_are_not_handed_out(shared_root, model):
    fixtures = REPO / "tests" / "fixtures"
    sleeper = as_other(sys.executable, "-c", "import time; time.sleep(120)")
    try:
        # Another user's live server on GPU 0, registered in their own (trusted) folder.
        entry = ServerEntry(id="h_1", addr="127.0.0.1:1", experiment="e", trial="t",
                            gpus=[0], host=settings.hostname(), pid=sleeper.pid)  # fmt: skip
        write = (
            "import json, os, sys\n"
            "root, user, meta = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])\n"
            "for key, value in (('gen_servers/h_1', '127.0.0.1:1'),"
            " ('areal/servers/h_1', json.dumps(meta))):\n"
            "    d = os.path.join(root, user, 'e', 't', key)\n"
            "    os.makedirs(d, mode=0o755)\n"
            "    open(os.path.join(d, 'ENTRY'), 'w').write(value)\n"
        )
        # A uid without a passwd entry goes by its number, as settings.user() names it.
        as_other(sys.executable, "-c", write, str(shared_root), str(OTHER),
                 json.dumps(entry.to_json())).wait()  # fmt: skip
        # And nvidia-smi shows some process on GPU 2.
        env = {
            "PATH": f"{fixtures}:{os.environ['PATH']}",
            "FAKE_GPU_APPS": "GPU-c7e8f9a0-1b2c-3d4e-5f6a-7b8c9d0e1f24, 777, 40960",
        }
        plan = json.loads(areal("serve", "--backend", "sglang", "--model", str(model),
                                "--alloc", "sglang:d1", "--dry-run", "--json", env=env,
                                check=0).stdout)  # fmt: skip
        assert plan["processes"][0]["gpus"] == [1]
        res = areal("serve", "--backend", "sglang", "--model", str(model), "--alloc",
                    "sglang:d3", "--dry-run", env=env, check=2)  # fmt: skip
        assert f"user {OTHER}" in res.stderr and "pid 777" in res.stderr
    finally:
        sleeper.kill()
        sleeper.wait()


# -- 13. hostile names and values ------------------------------------------------------------


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--experiment", "x" * 300], "characters long"),
        (["--trial", "-rf"], "not usable"),
        (["--trial", "../up"], "not usable"),
        (["--health-timeout", "nan"], "not a finite number"),
    ],
)
def test_hostile_names_and_values_exit_2(model, args, needle):
    res = areal(*fake_serve_args(model, "--dry-run", *args), check=2)
    assert needle in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("value", ["-5", ".nan", ".inf", "0"])
def test_config_durations_are_checked_like_flags(model, tmp_path, value):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"health_timeout: {value}\n")
    res = areal(*fake_serve_args(model, "--config", str(cfg), "--dry-run"), check=2)
    assert "health_timeout" in res.stderr and "Traceback" not in res.stderr


def test_a_key_of_1_hides_only_the_key(model):
    plan = json.loads(
        areal(*fake_serve_args(model, "--api-key", "1", "--dry-run", "--json"), check=0).stdout
    )
    assert plan["api_key"] == "<set>"
    argv = plan["processes"][0]["argv"]
    assert argv[argv.index("--seed") + 1] == "1"  # the other 1s of the plan are still there
    assert argv.count("<api-key>") <= 1 and "1" not in [
        v for k, v in plan["processes"][0]["env"].items() if k.endswith("API_KEY")
    ]


def _other_python() -> list[str]:
    """A Python the other uid may run that imports areal_cli (the venv may live in a home only
    its owner enters): the system's of the same version, on this checkout's paths."""
    import sysconfig

    py = shutil.which(f"python{sys.version_info[0]}.{sys.version_info[1]}", path="/usr/bin")
    if py is None or shutil.which("unshare") is None:
        pytest.skip("needs unshare and a system python of the test's version")
    paths = os.pathsep.join([sysconfig.get_paths()["purelib"], str(REPO / "src")])
    return ["env", f"PYTHONPATH={paths}", "PYTHONDONTWRITEBYTECODE=1", py]


def _hidden(*argv: str) -> list[str]:
    """argv as the other uid in a mount namespace whose /proc hides other users' processes
    (hidepid=1: their /proc/PID files cannot be read, as on many shared login nodes)."""
    import shlex

    inner = " ".join(shlex.quote(a) for a in argv)
    return ["unshare", "-m", "sh", "-c",
            "mount -t proc -o hidepid=1 proc /proc && exec setpriv "
            f"--reuid={OTHER} --regid={OTHER} --clear-groups {inner}"]  # fmt: skip


def test_a_process_one_may_not_look_at_is_not_taken_for_dead(tmp_path):
    """Only "no such process" is death: a pid whose /proc entry cannot be read (permissions)
    keeps its job alive in `ps` and `stop`, and its watchdog does not tear the job down."""
    needs_other_user()
    py = _other_python()
    parent = subprocess.Popen(["sleep", "60"])
    ctime = psutil.Process(parent.pid).create_time()
    reaper = None
    try:
        probe = subprocess.run(
            _hidden(*py, "-c", f"open('/proc/{parent.pid}/stat').read()"),
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if "Operation not permitted" not in probe.stderr:
            pytest.skip(f"cannot hide /proc here: {probe.stderr[-300:]}")
        res = subprocess.run(
            _hidden(*py, "-c", "from areal_cli import procs; "
                    f"print(procs.pid_alive({parent.pid}, {ctime}), procs.pid_alive(2**22 + 7))"),
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert res.stdout.split() == ["True", "False"], res.stdout + res.stderr
        reaper = subprocess.Popen(
            _hidden(*py, "-m", "areal_cli.schedulers.local.reaper", "--parent", str(parent.pid),
                    "--marker", "areal-test-hidden", "--home", str(tmp_path / "home"),
                    "--experiment", "e", "--trial", "t", "--registry", str(tmp_path / "reg")),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        time.sleep(2.0)
        assert reaper.poll() is None, reaper.communicate()[0]  # the supervisor still runs
        parent.kill()
        parent.wait()
        t0 = time.monotonic()
        assert reaper.wait(timeout=10) == 0, reaper.communicate()[0]
        print(f"watchdog saw its hidden parent die after {time.monotonic() - t0:.2f}s")
    finally:
        parent.kill()
        parent.wait()
        if reaper is not None and reaper.poll() is None:
            reaper.kill()
            reaper.wait()
