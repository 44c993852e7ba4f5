"""One inference server replica, kept by a small runner beside it on its node:

    python -m areal_cli.launchers.replica PLAN.json --index N

The runner starts the server (its output straight to its log file, so a server never
blocks on a reader), waits for /health, registers it under a lease and renews the lease
while the server answers /health. A server that stops answering is taken out of discovery
and put back when it answers again; a server that exits is deregistered and the runner
exits with its code. Every scheduler runs replicas this way (local processes, Slurm steps),
so a server's liveness never depends on a supervisor being scheduled.

Ready means a generation was answered: the runner polls the backend's readiness route
(SGLang's /ready, which turns 200 only once the engine's own warm-up generation was
answered; /health elsewhere) and then sends the plan's `first_request` (one tiny
generation) where there is one, since an engine can pass /health and die on its first
forward pass (vLLM's CPU build did). A plan's `cpus` pin the server to those cores (an
engine's CPU build; replicas on cores of their own).

A server that exits while it serves (a crash, the OOM killer, a SIGKILL) is restarted by
the runner on the same GPUs, port and address: deregistered at once (trainers stop sending
to it), started again after a short backoff, and registered again once it answers a
generation, with its entry's `restarts` counted up and a fresh `started` (it holds its base
weights again: trainers realign it before they sample from it, worker/rollout.py). The
plan's `server_restarts` is the budget per rolling hour (0: never); past it the replica ends
as one that is not restarted does. A server that fails while it first starts is not
restarted: that failure would repeat. One server over several nodes is not restarted (its
nodes would have to meet again).

Exit codes: the server's own (128+signal when killed by one), 3 when it never became
healthy in time or failed its first request, 2 for a bad plan.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from areal_cli import backends, control, files, procs, request_errors, settings
from areal_cli.backends import FALLBACK, protocol_sglang
from areal_cli.errors import UsageError
from areal_cli.files import private_dir
from areal_cli.health import PROBE_TIMEOUT, _connect_host, first_request, probe_health
from areal_cli.launchers import node
from areal_cli.logfiles import fresh_log
from areal_cli.registry import ServerEntry, open_registry, server_id

EXIT_USAGE = 2
EXIT_TIMEOUT = 3
REPLICA_ENV = "AREAL_REPLICA_INDEX"
PORT_TOKEN = "{port}"  # in argv, replaced by the port chosen on the node
# Consecutive failed probes (one per renewal) before a server leaves discovery.
UNHEALTHY_AFTER = 2
# The first generation may still compile or warm kernels on a CPU build.
FIRST_REQUEST_TIMEOUT = 180.0
# Readiness polls back off to this (seconds): what it adds to the time to ready is at most
# itself, and each poll of a starting engine costs it a request and a line of its access log.
READY_POLL_CAP = 0.05
# Seconds a stopping runner waits for its deregistration before it stops the server anyway.
DEREGISTER_WAIT = 1.0
# The restart budget's window (seconds): at most `server_restarts` restarts within it.
RESTART_WINDOW = 3600.0
# Seconds before a restart, doubled for each restart still in the window, up to the cap: a
# server that crashes at once again must not spin, and the first restart is not held up.
RESTART_BACKOFF = 0.2
RESTART_BACKOFF_CAP = 30.0


class Replica:
    def __init__(self, plan: dict, index: int):
        self.plan = plan
        self.p = next(p for p in plan["processes"] if p["role"] == "server" and p["index"] == index)
        self.ttl = float(plan.get("registry_ttl") or 30.0)
        self.key = plan.get("api_key")
        self.stop = threading.Event()
        self.changed = threading.Event()  # the server exited or a stop was asked for
        self.server: subprocess.Popen | None = None
        self.entry = None
        self.registry = None
        self._log = None
        self._version = None  # _EngineVersion: the engine's package version
        self._access = None  # the engine's access log, read for its errors (request_errors)
        self.restarts = 0  # how often the server was started again after it exited
        self._restarted_at: collections.deque[float] = collections.deque()  # monotonic
        self.budget = max(0, int(plan.get("server_restarts") or 0))

    # -- log ------------------------------------------------------------------------------

    def say(self, text: str) -> None:
        """One line of our own into the server's log, where `areal logs` shows it in order."""
        line = f"[replica] {time.strftime('%H:%M:%S')} {text}\n".encode()
        try:
            os.write(self._log, line)
        except OSError:
            pass

    # -- phases ---------------------------------------------------------------------------

    def run(self) -> int:
        p = self.p
        host = p["host"]
        if host == node.NODE_ADDR:
            host = node.address()  # a cluster node's own address, known only on the node
        port = p.get("port") or node.free_port(host)
        tokens = {PORT_TOKEN: str(port), node.NODE_ADDR: host}
        leader = True
        if int(p.get("nodes") or 1) > 1:
            # One server over several nodes: they meet at an address the first node picks.
            dist = node.meet(Path(self.plan["run_dir"]) / f"server-{p['index']}.dist")
            dist_host, _, dist_port = dist.rpartition(":")
            rank = node.index()
            tokens.update({"{dist_addr}": dist, "{dist_host}": dist_host,
                           "{dist_port}": dist_port, "{node_rank}": str(rank)})  # fmt: skip
            leader = rank == 0
        argv = [_expand(a, tokens) for a in p["argv"]]
        if not leader:
            argv += list(p.get("follower_args") or ())
        private_dir(Path(p["log_path"]).parent)
        # O_APPEND: our lines and the server's interleave whole, never overwrite each other.
        self._log = fresh_log(p["log_path"])
        env = {**os.environ, **p["env"]}
        # Found by teardown even when this runner is gone (see replica_processes).
        env[REPLICA_ENV] = str(p["index"])
        cpus = [int(c) for c in p.get("cpus") or ()]
        self._launch = (argv, env, cpus)
        failed = self._spawn()
        if failed is not None:
            return failed

        # Read while the engine loads, for the entry (what AReaL's trainer is paired against).
        self._version = _EngineVersion(argv[0], p.get("backend"))
        if not leader:
            # Only the first node serves HTTP; the others hold their share of the model.
            self.say(f"node {node.name()} runs its part of server-{p['index']}")
            return self._follow()
        code, listed = self._bring_up(host, port)
        if code is not None:
            return code
        self._tell_ready()
        while True:
            code = self._keep(listed)
            if self.stop.is_set() or int(p.get("nodes") or 1) > 1:
                return code
            code, listed = self._restart(host, port, code)
            if code is not None:
                return code

    def _spawn(self) -> int | None:
        """Start the server process; None once started, else the exit code to end with."""
        argv, env, cpus = self._launch
        try:
            self.server = subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=self._log,
                stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            )  # fmt: skip
        except OSError as e:
            self.say(f"cannot start {argv[0]}: {e}")
            return 127
        server = self.server

        def wake_on_exit() -> None:
            server.wait()
            self.changed.set()

        threading.Thread(target=wake_on_exit, daemon=True).start()
        return None

    def _bring_up(self, host: str, port: int) -> tuple[int | None, bool]:
        """Wait until the started server answers a generation, then register it. Returns
        (None, listed) once it serves (listed: False while the registry does not answer),
        else (the exit code to end with, False)."""
        if not self._wait_healthy(host, port):
            code = self.server.poll()
            if code is not None:
                self.say(f"server exited while starting ({_describe(code)})")
                return _code(code), False
            if self.stop.is_set():
                return self._shutdown(), False
            self.say(f"not healthy after {self.plan['health_timeout']:g}s; stopping it")
            self._shutdown()
            return EXIT_TIMEOUT, False
        failed = self._first_request(host, port)
        if failed:
            code = self.server.poll()
            if code is not None:
                self.say(f"server exited on its first request ({_describe(code)}): {failed}")
                return _code(code), False
            self.say(f"server answers /health but failed its first request: {failed}; stopping it")
            self._shutdown()
            return EXIT_TIMEOUT, False
        listed = self._register(host, port)
        if listed is None:
            self._shutdown()
            return EXIT_USAGE, False
        return None, listed

    def _restart(self, host: str, port: int, code: int) -> tuple[int | None, bool]:
        """The server exited while it served (its entry is out already): start it again
        while the budget allows. (None, listed) once it serves again; else (the code to end
        with, False): the last exit's, or a stop's."""
        while True:
            now = time.monotonic()
            while self._restarted_at and now - self._restarted_at[0] > RESTART_WINDOW:
                self._restarted_at.popleft()
            if len(self._restarted_at) >= self.budget:
                if self.budget:
                    self.say(f"not restarted: {len(self._restarted_at)} restart(s) within the "
                             f"last hour, the budget (--max-restarts {self.budget})")  # fmt: skip
                return code, False
            # Whatever the dead server left (its workers hold GPUs and ports) goes first.
            self._reap()
            delay = min(RESTART_BACKOFF * 2 ** len(self._restarted_at), RESTART_BACKOFF_CAP)
            self._restarted_at.append(now)
            self.restarts += 1
            left = self.budget - len(self._restarted_at)
            self.say(f"restarting the server (restart {self.restarts}, {left} more allowed "
                     f"within the hour) in {delay:g}s")  # fmt: skip
            if self.stop.wait(delay):
                return self._shutdown(), False
            self.changed.clear()
            failed = self._spawn()
            if failed is not None:
                return failed, False
            got, listed = self._bring_up(host, port)
            if got is None:
                self._tell_ready()
                return None, listed
            if self.stop.is_set() or got == EXIT_USAGE:  # a registry that refuses us for good
                return got, False
            code = got

    def _reap(self) -> None:
        """SIGKILL what is left of the exited server: its process group, and the processes
        of this replica that left it (found by their environment)."""
        if self.server is not None:
            _signal_group(self.server.pid, signal.SIGKILL)
        marker = self.plan.get("marker")
        if not marker:
            return
        me = os.getpid()
        for proc in replica_processes(marker, self.p["index"]):
            if proc.pid != me:
                try:
                    proc.kill()
                except Exception:
                    pass

    def _follow(self) -> int:
        while self.server.poll() is None and not self.stop.is_set():
            self.changed.wait(1.0)
            self.changed.clear()
        return self._shutdown() if self.stop.is_set() else _code(self.server.returncode)

    def _tell_ready(self) -> None:
        """For a scheduler that watches files (Slurm): which replica is registered where."""
        run_dir = self.plan.get("run_dir")
        if not run_dir:
            return
        path = Path(run_dir) / f"server-{self.p['index']}.ready"
        info = {"addr": self.entry.addr, "node": self.entry.node, "pid": self.entry.pid}
        try:
            files.write_atomic(path, json.dumps(info))
        except (OSError, files.DiskFull) as e:
            self.say(f"cannot write {path}: {e}")

    def _wait_healthy(self, host: str, port: int) -> bool:
        deadline = time.monotonic() + float(self.plan["health_timeout"])
        path = self._ready_path()
        delay = 0.005
        while not self.stop.is_set() and time.monotonic() < deadline:
            if self.server.poll() is not None:
                return False
            if probe_health(host, port, path, self.key, timeout=PROBE_TIMEOUT):
                return True
            self.stop.wait(min(delay, READY_POLL_CAP))
            delay *= 2
        return False

    def _ready_path(self) -> str:
        """The backend's readiness route (SGLang's /ready answers at once where its /health
        takes a second; backends/protocol_sglang.py READINESS_PATH), else the plan's."""
        backend = backends.BACKENDS.get(self.p.get("backend") or "")
        return backend.ready_path if backend else self.p["health_path"]

    def _first_request(self, host: str, port: int) -> str | None:
        """Why the plan's first request failed, or None when it was answered (or there is
        none). A server that dies on it gets a moment to exit, so its code is reported."""
        req = self.p.get("first_request")
        if not req:
            return None
        path, body = req
        failed = first_request(host, port, path, body, self.key, timeout=FIRST_REQUEST_TIMEOUT)
        if failed:
            try:
                self.server.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass
        return failed

    def _register(self, host: str, port: int) -> None:
        where = _advertised_host(host)
        plan = self.plan
        self.registry = open_registry(plan["registry"])
        self.entry = ServerEntry(
            id=server_id(where, port),
            addr=f"{where}:{port}",
            experiment=plan["experiment"],
            trial=plan["trial"],
            backend=self.p.get("backend"),
            model_path=plan.get("model_path"),
            tp=plan.get("tp", 1),
            gpus=self.p.get("gpus") or _step_gpus(),
            host=settings.hostname(),
            pid=self.server.pid,
            pid_create_time=procs.create_time(self.server.pid),
            api_key_required=bool(self.key),
            job=f"{plan['experiment']}/{plan['trial']}",
            marker=plan["marker"],
            scheduler=plan.get("scheduler", "local"),
            scheduler_job_id=os.environ.get("AREAL_SCHEDULER_JOB_ID"),
            node=node.name(),
            engine_version=self._version.get() if self._version else None,
            restarts=self.restarts,
        )
        return self._publish(f"restart {self.restarts}: registered" if self.restarts
                             else "registered")  # fmt: skip

    def _publish(self, what: str) -> bool | None:
        """True once registered; False when the registry failed for now (it may be down for
        a while: keep serving, try again); None when it refuses us for good."""
        try:
            # Signed with the job's key: discovery hands the key only to entries it signed.
            if not self._unless_stopped(self.registry.register, self.entry, ttl=self.ttl,
                                        sign_with=self.key):  # fmt: skip
                return False
        except Exception as e:
            self.say(f"cannot register {self.entry.addr} in {self.registry.url}: {_why(e)}")
            return None if isinstance(e, UsageError) else False
        self.say(f"{what} {self.entry.addr} in {self.registry.url}")
        return True

    def _keep(self, listed: bool) -> int:
        """Renew the lease while the server answers /health; follow it until it exits."""
        host, _, port = self.entry.addr.rpartition(":")
        bad, failed_renewals, dropped = 0, 0, False
        interval = max(0.05, self.ttl / 3)
        while True:
            code = self.server.poll()
            if code is not None:
                out = "deregistered" if self._leave() else "its entry is left to expire"
                self.say(f"server exited ({_describe(code)}); {out}")
                return _code(code)
            self.changed.wait(interval)
            self.changed.clear()
            if self.stop.is_set():
                return self._shutdown()
            if self.server.poll() is not None:
                continue
            ok = probe_health(
                host, int(port), self.p["health_path"], self.key, timeout=min(5.0, interval)
            )
            if not ok and self._paused(host, int(port), min(5.0, interval)):
                # A paused server fails /health (it generates nothing) yet is alive: a
                # weight sync paused it, and must find it listed when it resumes.
                ok = True
            if self.server.poll() is not None:
                continue
            if not ok:
                bad += 1
                if listed and bad >= UNHEALTHY_AFTER:
                    self._leave()
                    listed, dropped = False, True
                    self.say("server stopped answering /health; taken out of discovery")
                continue
            bad = 0
            if not listed:
                what = "answers /health again; registered" if dropped else "registered"
                listed = bool(self._publish(what))
                dropped = dropped and not listed
                continue
            # What it answered with errors, carried with the renewal (request_errors).
            errors = self._errors(host, int(port), min(5.0, interval))
            updates = {"errors": errors} if errors != self.entry.errors else {}
            try:
                if not self._unless_stopped(self.registry.keepalive, self.entry,
                                            sign_with=self.key, **updates):  # fmt: skip
                    continue  # a stop came first
                if failed_renewals:
                    self.say(f"renewal works again after {failed_renewals} failure(s)")
                failed_renewals = 0
            except Exception as e:
                failed_renewals += 1
                self.say(f"renewal failed ({failed_renewals}): {_why(e)}")
                # The registry may be back without our entry (its lease ran out meanwhile):
                # a fresh registration under a new lease puts the server back.
                if self._publish("registered again"):
                    failed_renewals = 0

    def _errors(self, host: str, port: int, timeout: float) -> dict | None:
        """The server's requests answered with errors lately: the hf server counts its own;
        an engine's are read from its access log, which this runner writes."""
        engine = backends.find(self.p.get("backend"))
        if engine is not None and engine.built_in:
            got = control._call(f"{_connect_host(host)}:{port}", "GET",
                                protocol_sglang.SERVER_INFO_PATHS[0], self.key, timeout)  # fmt: skip
            return request_errors.from_server_info(got[1]) if got and got[0] == 200 else None
        if self._access is None:
            self._access = request_errors.AccessLog(self.p["log_path"])
        return self._access.read()

    def _paused(self, host: str, port: int, timeout: float) -> bool:
        backend = self.p.get("backend") or FALLBACK
        return control.paused(f"{_connect_host(host)}:{port}", backend, self.key, timeout) is True

    def _unless_stopped(self, fn, *args, **kwargs) -> bool:
        """A registry call that a stop does not wait for: a registry that does not answer
        (etcd stopped, a network partition) holds a request for its whole timeout, and the
        server must go when it is asked to, not seconds later. False: given up for a stop."""
        failed: list[BaseException] = []

        def call() -> None:
            try:
                fn(*args, **kwargs)
            except BaseException as e:
                failed.append(e)

        t = threading.Thread(target=call, daemon=True)
        t.start()
        while t.is_alive() and not self.stop.is_set():
            t.join(0.1)
        if failed:
            raise failed[0]
        return not t.is_alive()

    def _leave(self) -> bool:
        """Deregister; once a stop is asked for, wait at most DEREGISTER_WAIT more for it.
        True when the entry is out."""
        done: list[bool] = []
        t = threading.Thread(target=lambda: done.append(self._deregister()), daemon=True)
        t.start()
        while t.is_alive() and not self.stop.is_set():
            t.join(0.1)
        t.join(DEREGISTER_WAIT)
        return done == [True]

    def _deregister(self) -> bool:
        if self.entry is None:
            return True
        try:
            self.registry.deregister(
                self.entry.experiment, self.entry.trial, self.entry.id, self.entry.lease
            )
            return True
        except Exception as e:
            self.say(f"cannot deregister {self.entry.addr}: {_why(e)}")
            return False

    def _shutdown(self) -> int:
        # Out of discovery before the server goes, but a registry that does not answer must
        # not keep it running: its lease (or heartbeat) runs out without us.
        self._leave()
        server = self.server
        if server is None:
            return 0
        if server.poll() is None:
            _signal_group(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                _signal_group(server.pid, signal.SIGKILL)
                server.wait()
        return _code(server.returncode)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _code(code: int) -> int:
    return 128 - code if code < 0 else code


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _why(e: Exception) -> str:
    return getattr(e, "message", None) or f"{type(e).__name__}: {e}"


def _expand(arg: str, tokens: dict[str, str]) -> str:
    for token, value in tokens.items():
        arg = arg.replace(token, value)
    return arg


def _step_gpus() -> list[int]:
    """The GPUs its scheduler bound to this step (their indices on the node): those it names
    in AREAL_STEP_GPUS (Slurm's), or, from a scheduler that sets them itself (Ray), those in
    CUDA_VISIBLE_DEVICES."""
    raw = os.environ.get("AREAL_STEP_GPUS", "")
    if not raw and os.environ.get("AREAL_SCHEDULER_JOB_ID"):
        raw = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return [int(g) for g in raw.split(",") if g.strip().isdigit()]


def _advertised_host(host: str) -> str:
    """The address other machines use to reach a server bound to `host`: for a wildcard
    bind, the first non-loopback IPv4 address of this host (the hostname often resolves to
    127.0.1.1), else the hostname."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    import ipaddress

    import psutil

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    return socket.gethostname()


def replica_processes(marker: str, index: int) -> list:
    """The processes of one replica of a job (its server and the server's helpers), found by
    their environment: a runner killed by SIGKILL leaves its server to init."""
    out = []
    for p in procs.find_marked(marker):
        try:
            if p.environ().get(REPLICA_ENV) == str(index):
                out.append(p)
        except Exception:
            continue
    return out


class _EngineVersion:
    """The engine package's version in the server's interpreter, read in a thread (one
    short subprocess) while the engine loads; None where it cannot be read."""

    _PROBE = (
        "import sys; from importlib import metadata as m; "
        "d = m.packages_distributions().get(sys.argv[1]) or []; "
        "print(m.version(d[0]) if d else '')"
    )

    def __init__(self, python: str, backend: str | None):
        b = backends.find(backend)
        self._value: str | None = None
        self._thread = None
        if b is None or b.built_in:  # ours: its version is areal's own
            return
        self._thread = threading.Thread(
            target=self._read, args=(python, b.package.split(".")[0]), daemon=True
        )
        self._thread.start()

    def _read(self, python: str, package: str) -> None:
        try:
            out = subprocess.run([python, "-c", self._PROBE, package], capture_output=True,
                                 text=True, timeout=60)  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return
        self._value = out.stdout.strip() or None if out.returncode == 0 else None

    def get(self) -> str | None:
        if self._thread is not None:
            self._thread.join(timeout=60)
        return self._value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m areal_cli.launchers.replica")
    ap.add_argument("plan", help="the job's plan (JSON)")
    ap.add_argument("--index", type=int, required=True, help="which server replica")
    args = ap.parse_args(argv)
    try:
        plan = json.loads(Path(args.plan).read_text())
        replica = Replica(plan, args.index)
    except (OSError, ValueError, KeyError, StopIteration) as e:
        print(f"replica: bad plan {args.plan}: {e}", file=sys.stderr)
        return 2

    def stop(*_) -> None:
        replica.stop.set()
        replica.changed.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return replica.run()


if __name__ == "__main__":
    sys.exit(main())
