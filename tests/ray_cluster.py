"""A real local Ray cluster of two nodes on this host, for the tests and the benchmarks.

    cluster = start_ray_cluster()      # head at 127.0.0.2, one worker node at 127.0.0.3
    cluster.address                    # "127.0.0.2:PORT", what RAY_ADDRESS gets
    cluster.env                        # what a client needs: RAY_ADDRESS, RAY_AUTH_* (no secret)
    stop_ray_cluster(cluster)

What was measured with ray 2.60 and shapes this:
- two Ray nodes share one host only at distinct addresses: 127.0.0.2 and 127.0.0.3
  (127.0.0.1 is silently replaced by the host's own address), each with its own temp dir
  and its own ports (the dashboard agent's 52365 is fixed unless set);
- the cluster is secured as a user's would be: token authentication on
  (RAY_AUTH_MODE=token), the token in a 0600 file named by RAY_AUTH_TOKEN_PATH, never on a
  command line, and HOME moved so that nothing reads or writes ~/.ray/auth_token;
- Ray's daemons detach from `ray start` (re-parented to init): they are not the test's
  children, and stop_ray_cluster ends them by pid (every process under the cluster's
  folder, found by its command line and its session folder), never with `ray stop`, which
  would end any Ray of this host;
- each node gets 2 CPUs and a 80 MB object store: Ray sizes its store from the host's
  memory otherwise.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

VENV_BIN = Path(sys.executable).parent
RAY = VENV_BIN / "ray"
HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"
NODE_CPUS = 2
OBJECT_STORE = 80 * 1024 * 1024
START_TIMEOUT = 120.0


def ray_missing() -> str | None:
    if not RAY.exists():
        return "Ray is not installed (pip install 'areal-cli[ray]')"
    return None


@dataclass
class RayCluster:
    root: Path
    address: str  # HEAD_IP:gcs port
    token_file: Path
    nodes: list[str] = field(default_factory=lambda: [HEAD_IP, WORKER_IP])
    owned: bool = True  # started here, so stopped here

    @property
    def env(self) -> dict[str, str]:
        """What a client of this cluster sets: where it is and how it authenticates (the
        token by file, so it never appears in an environment listing or argv)."""
        return {
            "RAY_ADDRESS": self.address,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(self.token_file),
        }

    def processes(self) -> list[psutil.Process]:
        return _cluster_processes(self.root)


def _free_ports(n: int, host: str) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _worker_ports(host: str, count: int = 40) -> tuple[int, int]:
    """A run of `count` free ports for one node's Ray workers, above the tests' blocks."""
    base = int(os.environ.get("AREAL_TEST_PORT_BASE", "30000"))
    start = 20000 + (base % 20000) // 2 + (0 if host == HEAD_IP else count)
    for lo in range(start, 29000, 2 * count):
        ok = True
        for port in range(lo, lo + count):
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    ok = False
                    break
        if ok:
            return lo, lo + count - 1
    raise RuntimeError(f"no run of {count} free ports for Ray workers on {host}")


def _daemon_env(root: Path, token_file: Path) -> dict[str, str]:
    return {
        "PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": str(root),
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token_file),
        "RAY_USAGE_STATS_ENABLED": "0",
        # The tests' own servers and ranks stay at one thread each (conftest.py).
        "OMP_NUM_THREADS": "1",
        # tests/fixtures/fake_python.py hands what is not a server to this interpreter.
        "FAKE_REAL_PYTHON": sys.executable,
        # The job's processes run the code under test, wherever this run imports it from.
        **({"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}),
    }


def _node_args(ip: str, temp: Path) -> list[str]:
    (
        node_manager, object_manager, agent_http, agent_grpc, metrics, runtime_env,
    ) = _free_ports(6, ip)  # fmt: skip
    lo, hi = _worker_ports(ip)
    return [
        "--node-ip-address", ip, "--num-cpus", str(NODE_CPUS),
        "--object-store-memory", str(OBJECT_STORE), "--temp-dir", str(temp),
        "--node-manager-port", str(node_manager), "--object-manager-port", str(object_manager),
        "--dashboard-agent-listen-port", str(agent_http),
        "--dashboard-agent-grpc-port", str(agent_grpc),
        "--metrics-export-port", str(metrics), "--runtime-env-agent-port", str(runtime_env),
        "--min-worker-port", str(lo), "--max-worker-port", str(hi),
        "--disable-usage-stats",
    ]  # fmt: skip


def _ray_start(args: list[str], env: dict[str, str], log: Path) -> None:
    with open(log, "ab") as out:
        res = subprocess.run(
            [str(RAY), "start", *args], env=env, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, timeout=START_TIMEOUT, check=False,
        )  # fmt: skip
    if res.returncode != 0:
        raise RuntimeError(f"ray start failed ({res.returncode}): {log.read_text()[-3000:]}")


def start_ray_cluster() -> RayCluster:
    """A cluster of our own; or the one `python tests/ray_cluster.py` keeps up, when
    AREAL_RAY_CLUSTER names the file it wrote (reused, left up)."""
    shared = os.environ.get("AREAL_RAY_CLUSTER")
    if shared and Path(shared).is_file():
        env = json.loads(Path(shared).read_text())
        token = Path(env["RAY_AUTH_TOKEN_PATH"])
        return RayCluster(root=token.parent, address=env["RAY_ADDRESS"], token_file=token,
                          owned=False)  # fmt: skip
    # Short: Ray's Unix socket paths under the temp dir have a length limit.
    root = Path(tempfile.mkdtemp(prefix="rc-", dir="/tmp"))
    token_file = root / "token"
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    env = _daemon_env(root, token_file)
    (gcs,) = _free_ports(1, HEAD_IP)
    cluster = RayCluster(root=root, address=f"{HEAD_IP}:{gcs}", token_file=token_file)
    try:
        head = [
            "--head", "--port", str(gcs), "--include-dashboard", "false",
            "--ray-client-server-port", str(_free_ports(1, HEAD_IP)[0]),
            *_node_args(HEAD_IP, root / "h"),
        ]  # fmt: skip
        _ray_start(head, env, root / "head.log")
        worker = ["--address", cluster.address, *_node_args(WORKER_IP, root / "w")]
        _ray_start(worker, env, root / "worker.log")
        _wait_nodes(cluster, env, 2)
    except BaseException:
        stop_ray_cluster(cluster)
        raise
    return cluster


def _wait_nodes(cluster: RayCluster, env: dict[str, str], n: int) -> None:
    """Until the head lists `n` live nodes (a worker registers a moment after `ray start`)."""
    code = (
        "import ray, sys, time\n"
        "ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False)\n"
        "deadline = time.time() + 60\n"
        "while sum(x['Alive'] for x in ray.nodes()) < int(sys.argv[2]):\n"
        "    if time.time() > deadline: sys.exit('nodes missing')\n"
        "    time.sleep(0.2)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, cluster.address, str(n)], env={**env, **cluster.env},
        capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    if res.returncode != 0:
        raise RuntimeError(f"the Ray cluster did not come up: {res.stderr[-2000:]}")


def _cluster_processes(root: Path) -> list[psutil.Process]:
    """Ray's daemons and workers of this cluster: their command lines or working
    directories name its folder, or they descend from one that does."""
    needle = str(root)
    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["pid", "cmdline", "environ"]):
        try:
            cmd = " ".join(p.info["cmdline"] or ())
            env = p.info["environ"] or {}
        except psutil.Error:
            continue
        if needle in cmd or env.get("RAY_AUTH_TOKEN_PATH", "").startswith(needle):
            found[p.pid] = p
    return [p for p in _with_descendants(found) if p.pid != os.getpid()]


def _with_descendants(found: dict[int, psutil.Process]) -> list[psutil.Process]:
    for p in list(found.values()):
        try:
            for c in p.children(recursive=True):
                found.setdefault(c.pid, c)
        except psutil.Error:
            continue
    return list(found.values())


def _signal_all(procs: list[psutil.Process], sig: int) -> None:
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def node_processes(cluster: RayCluster, ip: str) -> list[psutil.Process]:
    """One node of the cluster as a crash would take it: its daemons (its raylet names its
    address, the others its session folder) and everything under them, its workers and what
    they started (a job's runners, torchrun, ranks)."""
    sessions = []
    for p in _cluster_processes(cluster.root):
        try:
            argv = p.cmdline()
        except psutil.Error:
            continue
        if argv and argv[0].endswith("raylet") and f"--node_ip_address={ip}" in argv:
            sessions += [a.split("=", 1)[1] for a in argv if a.startswith("--session_dir=")]
    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or ())
        if sessions and any(s in cmd for s in sessions):
            found[p.pid] = p
    return _with_descendants(found)


def kill_node(cluster: RayCluster, ip: str = WORKER_IP) -> int:
    """SIGKILL every process of one node at once, as if its host had crashed. Returns how
    many there were."""
    procs = node_processes(cluster, ip)
    if not procs:
        raise RuntimeError(f"no Ray node at {ip} in {cluster.root}")
    _signal_all(procs, signal.SIGKILL)
    psutil.wait_procs(procs, timeout=10)
    return len(procs)


def restart_worker(cluster: RayCluster, ip: str = WORKER_IP) -> None:
    """A worker node at `ip` again (after kill_node), in a temp folder of its own: the
    cluster has its two nodes again for the tests that follow."""
    env = _daemon_env(cluster.root, cluster.token_file)
    temp = Path(tempfile.mkdtemp(prefix="w", dir=cluster.root))
    _ray_start(["--address", cluster.address, *_node_args(ip, temp)], env,
               cluster.root / "worker.log")  # fmt: skip
    _wait_nodes(cluster, env, 2)


def stop_ray_cluster(cluster: RayCluster, grace: float = 5.0) -> None:
    if not cluster.owned:
        return
    procs = _cluster_processes(cluster.root)
    _signal_all(procs, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace)
    _signal_all(alive, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=grace)
    shutil.rmtree(cluster.root, ignore_errors=True)


if __name__ == "__main__":
    # python tests/ray_cluster.py FILE: start one, write its env to FILE (for
    # AREAL_RAY_CLUSTER=FILE), keep it up until SIGTERM or Ctrl-C.
    os.environ.pop("AREAL_RAY_CLUSTER", None)
    t0 = time.monotonic()
    c = start_ray_cluster()
    Path(sys.argv[1]).write_text(json.dumps(c.env))
    print(f"up in {time.monotonic() - t0:.1f}s:", " ".join(f"{k}={v}" for k, v in c.env.items()))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        stop_ray_cluster(c)
