"""Real Slurm and etcd daemons for the tests (a pytest plugin, loaded by tests/conftest.py).

Fixtures
  slurm_cluster          session: a two-node cluster from scripts/local-slurm.sh (reused when one
                         is already up in $AREAL_SLURM_STATE or /tmp/areal-slurm). Attributes:
                         .conf_path .env .nodes .partition .gpus_per_node .state_dir .log_dir;
                         helpers .environ() .run() .sbatch() .job_state() .wait_job()
                         .squeue_json() .node_state().
  slurm_env              function: slurm_cluster, with SLURM_CONF set in os.environ for the test.
  private_slurm_cluster  function: a cluster of the test's own, for faults (.kill_node/.start_node).
  etcd_server            session: a plain etcd. Attributes: .url "etcd://127.0.0.1:PORT",
                         .endpoint "http://127.0.0.1:PORT", .pid; helpers .put/.get/.get_prefix/
                         .grant/.keepalive/.revoke/.post/.clear(). Never stop it in a test.
  etcd                   function: etcd_server, emptied (keys and leases) before the test.
  etcd_factory           function: etcd_factory(auth=False, tls=False) -> a started etcd of the
                         test's own; .stop() .kill() .start() .restart(); auth: .user .password;
                         tls: .ca_file (https endpoint). make_ca(dir) makes another CA to be wrong.

  ray_cluster            session: a two-node Ray cluster on this host (tests/ray_cluster.py: head
                         127.0.0.2, worker 127.0.0.3, token auth). Attributes: .address .env
                         .nodes .root .token_file.
  ray_env                function: ray_cluster, with RAY_ADDRESS and RAY_AUTH_* set for the test.

Markers `slurm`, `etcd` and `ray` (added to every test that uses these fixtures) skip when the packages
are missing, and fail instead when AREAL_REQUIRE_SLURM=1 / AREAL_REQUIRE_ETCD=1 /
AREAL_REQUIRE_RAY=1. Marker `engines` (tests/engines/, and the conformance tests' real-SGLang
runs) does the same for the real engines' CPU builds (`make engines`), with
AREAL_REQUIRE_ENGINES=1.

The daemons run with a clean environment (no AREAL_HOME), so the leak check never counts them;
each fixture stops, by pid, only what it started.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
LOCAL_SLURM = REPO / "scripts" / "local-slurm.sh"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_SLURM_STATE = "/tmp/areal-slurm"
ENDED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


# Daemons of session fixtures: they outlive the test that happened to start them first, so
# the per-test leak check (conftest.py) must not count them; the session's end stops them.
SESSION_DAEMONS: set[int] = set()


def _which(name: str) -> str | None:
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}:{SYSTEM_PATH}")


def _clean_env(**extra: str) -> dict[str, str]:
    """What the daemons get: no AREAL_HOME, nothing of the test's."""
    return {"PATH": SYSTEM_PATH, "LANG": "C.UTF-8", **extra}


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _wait(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout:.0f} s")
        time.sleep(interval)


# ---------------------------------------------------------------- availability and markers


def slurm_missing() -> str | None:
    """Why the local Slurm cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return "the local Slurm cluster runs its daemons as root"
    missing = [n for n in ("slurmctld", "slurmd", "sbatch", "munged") if not _which(n)]
    if missing:
        return (
            f"Slurm is not installed ({', '.join(missing)} missing; "
            "apt-get install slurmctld slurmd slurm-client munge)"
        )
    return None


def etcd_missing() -> str | None:
    if not _which("etcd"):
        return "etcd is not installed (apt-get install etcd-server)"
    return None


def engines_missing() -> str | None:
    from tests.engines.engines import missing

    reasons = [r for r in (missing("sglang"), missing("vllm")) if r]
    return "; ".join(reasons) or None


def areal_missing() -> str | None:
    from tests.areal.areal_venv import missing

    return missing()


SERVICES = {
    # marker: (fixtures that imply it, why-missing check, variable that turns a skip into a failure)
    "slurm": (
        {"slurm_cluster", "slurm_env", "private_slurm_cluster"},
        slurm_missing,
        "AREAL_REQUIRE_SLURM",
    ),
    "etcd": ({"etcd_server", "etcd", "etcd_factory"}, etcd_missing, "AREAL_REQUIRE_ETCD"),
    "ray": ({"ray_cluster", "ray_env"}, lambda: ray_missing(), "AREAL_REQUIRE_RAY"),
    "engines": (set(), engines_missing, "AREAL_REQUIRE_ENGINES"),
    "areal": (set(), areal_missing, "AREAL_REQUIRE_AREAL"),
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker, (fixtures, _, _) in SERVICES.items():
            if fixtures & set(getattr(item, "fixturenames", ())):
                item.add_marker(marker)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    for marker, (_, missing, require) in SERVICES.items():
        if item.get_closest_marker(marker) is None:
            continue
        reason = missing()
        if reason is None:
            continue
        if os.environ.get(require) == "1":
            pytest.fail(f"{reason}, and {require}=1", pytrace=False)
        pytest.skip(reason)


# ---------------------------------------------------------------- Slurm


@dataclass
class SlurmCluster:
    state_dir: Path
    nodes: list[str] = field(default_factory=list)
    partition: str = ""
    gpus_per_node: int = 0
    owned: bool = False  # started by this fixture, so stopped by it

    @property
    def conf_path(self) -> Path:
        return self.state_dir / "slurm.conf"

    @property
    def log_dir(self) -> Path:
        """slurmctld.log, slurmd-NODE.log, munged.log."""
        return self.state_dir / "log"

    @property
    def env(self) -> dict[str, str]:
        """What a subprocess needs on top of its environment to talk to this cluster."""
        return {"SLURM_CONF": str(self.conf_path)}

    def environ(self, **extra: str) -> dict[str, str]:
        """os.environ as it is now (the test's AREAL_HOME included), plus `env` and `extra`."""
        return {**os.environ, **self.env, **extra}

    def run(
        self, *argv: str, check: bool = True, timeout: float = 60, **kw
    ) -> subprocess.CompletedProcess:
        kw.setdefault("env", self.environ())
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
        if check and res.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv)} exited {res.returncode}\n{res.stdout}\n{res.stderr}"
            )
        return res

    def sbatch(self, script: str, *args: str, cwd: Path | None = None) -> str:
        """Submit `script` (the text of a batch script) and return the job id."""
        res = self.run("sbatch", "--parsable", *args, input=script, cwd=cwd)
        return res.stdout.strip().split(";")[0]

    def job_state(self, job_id: str) -> str:
        """The job's state (squeue --states all); for a heterogeneous job, its first component's."""
        out = self.run("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T", check=False)
        return out.stdout.split()[0] if out.stdout.split() else ""

    def wait_job(self, job_id: str, timeout: float = 60) -> str:
        """Wait until the job has ended; returns its final state."""

        def ended():
            state = self.job_state(job_id)
            return state if state in ENDED else None

        return _wait(ended, timeout, f"job {job_id} did not end", interval=0.1)

    def squeue_json(self) -> list[dict]:
        return json.loads(self.run("squeue", "--json").stdout)["jobs"]

    def node_state(self, node: str) -> str:
        return self.run("sinfo", "-h", "-N", "-n", node, "-o", "%T").stdout.strip()

    @contextlib.contextmanager
    def controller_stopped(self):
        """slurmctld SIGSTOPped (a hung controller: clients time out, squeue --json answers
        {"errors": [...], "jobs": []}) for the block; SIGCONT whatever happens, since the
        shared cluster serves every test of the session."""
        ctld = psutil.Process(int((self.state_dir / "run" / "slurmctld.pid").read_text()))
        ctld.suspend()
        try:
            yield ctld
        finally:
            ctld.resume()
            _wait(lambda: self.run("scontrol", "ping", check=False).returncode == 0, 30,
                  "slurmctld did not answer again")  # fmt: skip

    # Faults, for a private cluster. A node that dies: its slurmd is killed, the controller told
    # (it would notice after SlurmdTimeout), then the node's job steps and tasks are killed; in
    # that order its jobs end as NODE_FAIL (requeued unless submitted with --no-requeue) rather
    # than failing on their own first.
    def kill_node(self, node: str) -> None:
        victims = []
        try:
            slurmd = psutil.Process(
                int((self.state_dir / "run" / f"slurmd-{node}.pid").read_text())
            )
            slurmd.kill()
            victims.append(slurmd)
        except (OSError, ValueError, psutil.Error):
            pass
        self.run("scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=killed")

        def dead() -> bool:  # again until none is left: a step may be forking a task meanwhile
            left = [p for p in victims + self._node_processes(node) if _alive(p)]
            for p in left:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            victims[:] = left
            return not left

        _wait(dead, 10, f"{node} did not die", interval=0.1)

        def down() -> bool:  # a reply slurmd sent before it died can bring the node back once
            if self.node_state(node).startswith("down"):
                return True
            self.run("scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=killed")
            return False

        _wait(down, 10, f"{node} is not marked down", interval=0.2)

    def start_node(self, node: str) -> None:
        """slurmd started again; the node returns to service when it registers."""
        subprocess.run(
            ["slurmd", "-f", str(self.conf_path), "-N", node],
            executable=_which("slurmd"),
            env=_clean_env(SLURM_CONF=str(self.conf_path)),
            check=True,
            timeout=60,
        )
        _wait(lambda: self.node_state(node) == "idle", 60, f"node {node} did not come back")

    def _node_processes(self, node: str) -> list[psutil.Process]:
        """This node's slurmstepd (by their sockets in the node's spool dir: they blank their
        environment for the process title) and its job tasks (by their environment)."""
        conf = str(self.conf_path)
        spool = str(self.state_dir / "spool" / node) + "/"
        found = []
        for p in psutil.process_iter(["name"]):
            try:
                if p.info["name"] == "slurmstepd":
                    paths = [c.laddr for c in p.net_connections("unix")]
                    if any(isinstance(a, str) and a.startswith(spool) for a in paths):
                        found.append(p)
                    continue
                env = p.environ()
                if (
                    env.get("SLURM_CONF") == conf
                    and env.get("SLURMD_NODENAME") == node
                    and env.get("SLURM_JOB_ID")
                ):
                    found.append(p)
            except psutil.Error:
                continue
        return found


def _alive(p: psutil.Process) -> bool:
    """Running and not a zombie (init here can take seconds to reap a killed daemon)."""
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _slurm_script(cmd: str, state: Path, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(
        ["bash", str(LOCAL_SLURM), cmd, str(state)],
        capture_output=True,
        text=True,
        env=_clean_env(HOME=os.environ.get("HOME", "/root")),
        timeout=180,
    )
    if check and res.returncode != 0:
        raise RuntimeError(f"local-slurm.sh {cmd} {state} failed:\n{res.stdout}\n{res.stderr}")
    return res


def _describe(state: Path, owned: bool) -> SlurmCluster:
    cluster = SlurmCluster(state_dir=state, owned=owned)
    out = cluster.run("sinfo", "-h", "-N", "-o", "%N|%P|%G").stdout
    for line in out.splitlines():
        node, partition, gres = line.split("|")
        if node not in cluster.nodes:
            cluster.nodes.append(node)
        if partition.endswith("*") or not cluster.partition:
            cluster.partition = partition.rstrip("*")
        m = re.search(r"gpu:(?:[^:(,]+:)?(\d+)", gres)
        cluster.gpus_per_node = int(m.group(1)) if m else 0
    return cluster


def start_slurm_cluster() -> SlurmCluster:
    """Reuse a cluster that is up in $AREAL_SLURM_STATE (or /tmp/areal-slurm), else start one
    in a fresh directory (kept short: the munge socket path has a length limit)."""
    shared = Path(os.environ.get("AREAL_SLURM_STATE") or DEFAULT_SLURM_STATE)
    if (shared / "slurm.conf").exists() and _slurm_script(
        "status", shared, check=False
    ).returncode == 0:
        return _describe(shared, owned=False)
    state = Path(tempfile.mkdtemp(prefix="areal-slurm-", dir="/tmp"))
    try:
        _slurm_script("up", state)
    except BaseException:
        _slurm_script("down", state, check=False)
        shutil.rmtree(state, ignore_errors=True)
        raise
    return _describe(state, owned=True)


def stop_slurm_cluster(cluster: SlurmCluster) -> None:
    if cluster.owned:
        _slurm_script("down", cluster.state_dir)
        shutil.rmtree(cluster.state_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster():
    reason = slurm_missing()
    if reason:  # reached only from a test without the marker's checks
        pytest.skip(reason)
    cluster = start_slurm_cluster()
    yield cluster
    stop_slurm_cluster(cluster)


@pytest.fixture
def slurm_env(slurm_cluster, monkeypatch):
    """slurm_cluster, with its SLURM_CONF in this test's environment."""
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    return slurm_cluster


@pytest.fixture
def private_slurm_cluster(monkeypatch):
    """A cluster of this test's own, for faults that would break the shared one."""
    monkeypatch.delenv("AREAL_SLURM_STATE", raising=False)
    state = Path(tempfile.mkdtemp(prefix="areal-slurm-", dir="/tmp"))
    try:
        _slurm_script("up", state)
        cluster = _describe(state, owned=True)
    except BaseException:
        _slurm_script("down", state, check=False)
        shutil.rmtree(state, ignore_errors=True)
        raise
    yield cluster
    stop_slurm_cluster(cluster)


# ---------------------------------------------------------------- Ray


def ray_missing() -> str | None:
    import ray_cluster as rc

    return rc.ray_missing()


@pytest.fixture(scope="session")
def ray_cluster():
    """Started once per session (Ray takes tens of seconds to come up on a busy host); its
    daemons are not this run's children and carry no AREAL_HOME, so the leak check never
    counts them; what the tests start on it does carry theirs."""
    import ray_cluster as rc

    reason = rc.ray_missing()
    if reason:
        pytest.skip(reason)
    cluster = rc.start_ray_cluster()
    yield cluster
    rc.stop_ray_cluster(cluster)


@pytest.fixture
def ray_env(ray_cluster, monkeypatch):
    """ray_cluster, with its address and auth (the token by file) in this test's environment."""
    for key, value in ray_cluster.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    return ray_cluster


# ---------------------------------------------------------------- etcd


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_ca(directory: Path, name: str = "areal test CA") -> Path:
    """A self-signed CA in `directory`: returns ca.crt (ca.key beside it)."""
    directory.mkdir(parents=True, exist_ok=True)
    crt, key = directory / "ca.crt", directory / "ca.key"
    _openssl(
        *("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
        *("-nodes", "-keyout", str(key), "-out", str(crt), "-days", "2", "-subj", f"/CN={name}"),
    )
    return crt


def issue_cert(ca_crt: Path, name: str = "server") -> tuple[Path, Path]:
    """A certificate for 127.0.0.1/localhost signed by the CA at ca_crt: (cert, key)."""
    d = ca_crt.parent
    crt, key, csr, ext = d / f"{name}.crt", d / f"{name}.key", d / f"{name}.csr", d / f"{name}.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl(
        *("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"),
        *("-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1"),
    )
    _openssl(
        *("x509", "-req", "-in", str(csr), "-CA", str(ca_crt), "-CAkey", str(d / "ca.key")),
        *("-CAcreateserial", "-out", str(crt), "-days", "2", "-extfile", str(ext)),
    )
    return crt, key


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def unb64(text: str) -> str:
    return base64.b64decode(text).decode()


class EtcdError(Exception):
    def __init__(self, status: int, body: Any):
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


class EtcdServer:
    """One etcd member on free loopback ports, its data in `workdir`. Talks to its v3 JSON
    gateway (3.4 serves it under /v3/ and /v3beta/; keys and values base64, int64s as strings)."""

    def __init__(self, workdir: Path, *, auth: bool = False, tls: bool = False):
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.data_dir = self.dir / "data"
        self.log_path = self.dir / "etcd.log"
        self.client_port, self.peer_port = _free_ports(2)
        self.auth = auth
        self.user = "areal" if auth else None
        self.password = secrets.token_urlsafe(12) if auth else None
        self.root_password = secrets.token_urlsafe(12) if auth else None
        self.ca_file: Path | None = None
        self.cert_file: Path | None = None
        self.key_file: Path | None = None
        if tls:
            self.ca_file = make_ca(self.dir / "tls")
            self.cert_file, self.key_file = issue_cert(self.ca_file)
        self._proc: subprocess.Popen | None = None
        self._log = None
        self._token: str | None = None
        self._auth_ready = False

    @property
    def tls(self) -> bool:
        return self.ca_file is not None

    @property
    def endpoint(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.running else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle
    def start(self, timeout: float = 60) -> EtcdServer:
        """Start (or start again: same ports, same data) and wait until it answers."""
        if self.running:
            return self
        first = not self.data_dir.exists()
        try:
            self._launch(timeout)
        except RuntimeError:
            if not first or "address already in use" not in self.log_tail():
                raise
            # Another process took a port between choosing it and etcd binding it.
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.client_port, self.peer_port = _free_ports(2)
            self._launch(timeout)
        if self.auth and not self._auth_ready:
            self._enable_auth()
        return self

    def _launch(self, timeout: float) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [
            _which("etcd") or "etcd",
            *("--name", "areal-test", "--data-dir", str(self.data_dir)),
            *("--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint),
            *("--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer),
            *("--initial-cluster", f"areal-test={peer}"),
            *("--logger", "zap", "--log-outputs", "stderr"),
            # One member: a short election timeout makes a restart answer in ~0.5 s, not ~1.5 s.
            *("--heartbeat-interval", "50", "--election-timeout", "500"),
        ]
        if self.tls:
            argv += ["--cert-file", str(self.cert_file), "--key-file", str(self.key_file)]
        self._log = open(self.log_path, "ab")
        self._proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=_clean_env(),
            start_new_session=True,
        )
        try:
            _wait(self._healthy, timeout, f"etcd on {self.endpoint} did not answer")
        except BaseException:
            self.kill()
            raise RuntimeError(f"etcd failed to start:\n{self.log_tail()}") from None

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM, then SIGKILL after `timeout`."""
        self._end(signal.SIGTERM, timeout)

    def kill(self) -> None:
        self._end(signal.SIGKILL, 10)

    def restart(self) -> EtcdServer:
        self.stop()
        return self.start()

    def _end(self, sig: int, timeout: float) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.send_signal(sig)
                try:
                    self._proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        self._token = None

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def _healthy(self) -> bool:
        if not self.running:
            raise RuntimeError(f"etcd exited with {self._proc.returncode}:\n{self.log_tail()}")
        try:
            req = urllib.request.Request(self.endpoint + "/health")
            with urllib.request.urlopen(req, timeout=2, context=self._ssl()) as resp:
                return json.loads(resp.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def _enable_auth(self) -> None:
        """root (needed to turn auth on) and `areal`, allowed to read and write every key."""
        calls = [
            ("/v3/auth/user/add", {"name": "root", "password": self.root_password}),
            ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
            ("/v3/auth/role/add", {"name": "areal"}),
            (
                "/v3/auth/role/grant",
                {
                    "name": "areal",
                    "perm": {"permType": "READWRITE", "key": "AA==", "range_end": "AA=="},
                },
            ),
            ("/v3/auth/user/add", {"name": self.user, "password": self.password}),
            ("/v3/auth/user/grant", {"user": self.user, "role": "areal"}),
            ("/v3/auth/enable", {}),
        ]
        for path, body in calls:
            self.post(path, body, token=False)
        self._auth_ready = True

    # -- the gateway
    def _ssl(self) -> ssl.SSLContext | None:
        return ssl.create_default_context(cafile=str(self.ca_file)) if self.tls else None

    def authenticate(self, user: str | None = None, password: str | None = None) -> str:
        """A token for user/password (default: the server's own user); EtcdError if refused."""
        body = {"name": user or self.user, "password": password or self.password}
        return self.post("/v3/auth/authenticate", body, token=False)["token"]

    def post(self, path: str, body: dict, token: str | bool | None = None) -> dict:
        """POST JSON to the gateway. token: None = log in as .user when auth is on, False = none,
        a string = that token (sent as the raw Authorization header, no "Bearer")."""
        if token is None and self.auth and self._auth_ready:
            self._token = self._token or self.authenticate()
            token = self._token
        req = urllib.request.Request(
            self.endpoint + path, data=json.dumps(body).encode(), method="POST"
        )
        req.add_header("Content-Type", "application/json")
        if token:
            req.add_header("Authorization", token)
        try:
            with urllib.request.urlopen(req, timeout=10, context=self._ssl()) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                detail = json.loads(raw)
            except ValueError:
                detail = raw.decode(errors="replace")
            raise EtcdError(e.code, detail) from None
        # keepalive is a stream: one JSON object per line, {"result": {...}}
        first = json.loads(raw.splitlines()[0]) if raw.strip() else {}
        return first.get("result", first)

    def put(self, key: str, value: str, lease: str | None = None) -> None:
        body = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = lease
        self.post("/v3/kv/put", body)

    def get(self, key: str) -> str | None:
        kvs = self.post("/v3/kv/range", {"key": b64(key)}).get("kvs", [])
        return unb64(kvs[0].get("value", "")) if kvs else None

    def get_prefix(self, prefix: str) -> dict[str, str]:
        """A plain prefix read, as AReaL's get_subtree does it (no trailing slash added)."""
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        kvs = self.post("/v3/kv/range", {"key": b64(prefix), "range_end": b64(end)}).get("kvs", [])
        return {unb64(kv["key"]): unb64(kv.get("value", "")) for kv in kvs}

    def grant(self, ttl: int) -> str:
        return self.post("/v3/lease/grant", {"TTL": ttl})["ID"]

    def keepalive(self, lease: str) -> int:
        """Renews the lease once; returns its TTL (0 when it had already expired)."""
        return int(self.post("/v3/lease/keepalive", {"ID": lease}).get("TTL", 0))

    def revoke(self, lease: str) -> None:
        self.post("/v3/lease/revoke", {"ID": lease})

    def clear(self) -> None:
        """Every key deleted and every lease revoked."""
        for lease in self.post("/v3/lease/leases", {}).get("leases", []):
            try:
                self.revoke(lease["ID"])
            except EtcdError:
                pass  # expired meanwhile
        self.post("/v3/kv/deleterange", {"key": "AA==", "range_end": "AA=="})


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory):
    reason = etcd_missing()
    if reason:
        pytest.skip(reason)
    server = EtcdServer(tmp_path_factory.mktemp("etcd")).start()
    SESSION_DAEMONS.add(server.pid)
    yield server
    SESSION_DAEMONS.discard(server.pid)
    server.stop()


@pytest.fixture
def etcd(etcd_server):
    """The session's etcd, emptied for this test."""
    if not etcd_server.running:
        raise RuntimeError("the session etcd was stopped by an earlier test; use etcd_factory")
    etcd_server.clear()
    return etcd_server


@pytest.fixture
def etcd_factory(tmp_path):
    """etcd_factory(auth=False, tls=False) -> a started EtcdServer of this test's own."""
    servers: list[EtcdServer] = []

    def make(*, auth: bool = False, tls: bool = False) -> EtcdServer:
        server = EtcdServer(tmp_path / f"etcd{len(servers)}", auth=auth, tls=tls)
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        server.stop()
