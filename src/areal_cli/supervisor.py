"""Scheduler.run for one host: spawn, stream logs, health-gate, register, watch, tear down.

The supervisor never prints. It reports through two callbacks:
    on_event(kind, info)   "spawned" | "healthy" | "ready" | "server_lost" | "trainer_exit" |
                           "stopping" | "heartbeat"
    on_line(label, line)   one line of a process's output ("server-0", "rank-1", ...)
and raises LaunchError (exit 1) or WaitTimeout (exit 3) for the first failure, root cause first.

Run as `python -m areal_cli.supervisor PLAN.json --home H` it is the daemon behind --detach.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from areal_cli import jobs, procs, settings
from areal_cli.errors import EXIT_INTERRUPTED, ArealError, LaunchError, UsageError, WaitTimeout
from areal_cli.health import probe_health
from areal_cli.launchers import torchrun
from areal_cli.registry import ServerEntry, open_registry, server_id
from areal_cli.spec import Plan, ProcessPlan

HEARTBEAT_EVERY = 5.0
TAIL_LINES = 20

EventFn = Callable[[str, dict], None]
LineFn = Callable[[str, str], None]


class _Proc:
    """One launched process with its log pump."""

    def __init__(
        self,
        plan: ProcessPlan,
        popen: subprocess.Popen,
        on_line: LineFn | None,
        changed: threading.Event,
    ):
        self.plan = plan
        self.popen = popen
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.rank_tails: dict[int, deque[str]] = {}
        self.healthy = False
        self.registered: ServerEntry | None = None
        self.lost = False
        self._on_line = on_line
        self._files: dict[str, object] = {}
        self.pump = threading.Thread(target=self._pump, name=f"log-{plan.label}", daemon=True)
        self.pump.start()
        # Wakes the supervisor the moment this process exits: no polling interval to wait out.
        self._changed = changed
        threading.Thread(target=self._wait, name=f"wait-{plan.label}", daemon=True).start()

    def _wait(self) -> None:
        self.popen.wait()
        self._changed.set()

    @property
    def label(self) -> str:
        return self.plan.label

    def _file(self, path: str):
        f = self._files.get(path)
        if f is None:
            # A new run starts its logs afresh (the previous run's are replaced).
            f = open(path, "wb", buffering=0)  # noqa: SIM115 - closed in _pump
            self._files[path] = f
        return f

    def _pump(self) -> None:
        main_log = self.plan.log_path
        log_dir = os.path.dirname(main_log)
        try:
            for raw in iter(self.popen.stdout.readline, b""):
                label, path, body = self.label, main_log, raw
                rank = None
                if self.plan.role == "trainer":
                    rank, body = torchrun.split_rank(raw)
                if rank is not None:
                    label, path = f"rank-{rank}", os.path.join(log_dir, f"rank-{rank}.log")
                self._file(path).write(body)
                text = body.decode(errors="replace").rstrip("\n")
                (
                    self.rank_tails.setdefault(rank, deque(maxlen=TAIL_LINES))
                    if rank is not None
                    else self.tail
                ).append(text)
                if self._on_line:
                    self._on_line(label, text)
        except (OSError, ValueError):
            pass
        finally:
            for f in self._files.values():
                f.close()

    def exit_code(self) -> int | None:
        return self.popen.poll()


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def advertised_host(host: str) -> str:
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
    return settings.hostname()


class Supervisor:
    def __init__(
        self,
        plan: Plan,
        home: Path,
        on_event: EventFn | None = None,
        on_line: LineFn | None = None,
    ):
        self.plan = plan
        self.home = home
        self.on_event = on_event or (lambda kind, info: None)
        self.on_line = on_line
        self.registry = open_registry(plan.registry)
        self.procs: list[_Proc] = []
        self.stop_requested = threading.Event()
        self.changed = threading.Event()  # a process exited, or a stop was requested
        self.stop_reason: str | None = None
        self._reaper: subprocess.Popen | None = None
        self._beat: threading.Thread | None = None
        self._finished = threading.Event()
        self.record: jobs.JobRecord | None = None

    # -- public ---------------------------------------------------------------------------

    def request_stop(self, reason: str = "interrupted") -> None:
        self.stop_reason = reason
        self.stop_requested.set()
        self.changed.set()

    def run(self) -> int:
        """Run the job to its end. Returns the exit code; raises for the first failure."""
        jobs.refuse_if_running(self.home, self.plan.experiment, self.plan.trial, self.plan.kind)
        self._slot = jobs.lock_slot(
            self.home, self.plan.experiment, self.plan.trial, self.plan.kind
        )
        settings.ensure_dir(self.plan.log_dir)
        # Entries left by servers that died with their supervisor and watchdog (a reboot):
        # AReaL's reader cannot tell them from live ones, so they go before we add ours.
        self.registry.prune(self.plan.experiment, self.plan.trial)
        self._write_api_key()
        self._start_record()
        self._start_reaper()
        error: ArealError | None = None
        code = 0
        try:
            code = self._run()
        except ArealError as e:
            error = e
            code = e.exit_code
        except BaseException:
            code = 1
            self._teardown("failed", "the supervisor crashed", 1)
            raise
        if error is not None:
            self._teardown("failed", error.message, code, error.detail)
            raise error
        state = "stopped" if code in (0, EXIT_INTERRUPTED) else "failed"
        self._teardown(state, self.stop_reason, code)
        return code

    # -- phases ---------------------------------------------------------------------------

    def _run(self) -> int:
        servers = self.plan.servers
        for p in servers:
            self._spawn(p)
        if servers:
            self._wait_healthy()
        if self.stop_requested.is_set():
            return EXIT_INTERRUPTED
        self._set_state("running")
        self.on_event(
            "ready", {"servers": [p.plan.addr for p in self.procs if p.plan.role == "server"]}
        )
        for p in self.plan.trainers:
            self._spawn(p)
            self._set_state("running")
            self._record_rendezvous(self.procs[-1])
        return self._watch()

    def _record_rendezvous(self, proc: _Proc) -> None:
        """A standalone torchrun binds the port the OS gave it: record it in the job record,
        where other jobs planning on this host count it as taken."""
        if "--standalone" not in proc.plan.argv:
            return
        port: list[int] = []

        def bound() -> bool:
            found = torchrun.rendezvous_port(proc.popen.pid)
            if found:
                port.append(found)
            return bool(port) or proc.exit_code() is not None or self.stop_requested.is_set()

        procs.wait_until(bound, timeout=60.0, cap=0.1)
        if port:
            rec = next(r for r in self.record.processes if r.pid == proc.popen.pid)
            rec.addr = f"127.0.0.1:{port[0]}"
            jobs.write(self.home, self.record)

    def _spawn(self, p: ProcessPlan) -> None:
        Path(p.log_path).parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **p.env, procs.MARKER_ENV: self.plan.marker}
        if p.env.get("CUDA_VISIBLE_DEVICES") == "":
            env.pop("CUDA_VISIBLE_DEVICES", None)
            env["CUDA_VISIBLE_DEVICES"] = ""
        try:
            popen = procs.spawn(p.argv, env=env)
        except OSError as e:
            raise LaunchError(
                f"{p.label} could not start: {e}", hint=f"argv: {' '.join(p.argv)}"
            ) from None
        proc = _Proc(p, popen, self.on_line, self.changed)
        self.procs.append(proc)
        self.record.processes.append(
            jobs.ProcessRecord(
                role=p.role,
                index=p.index,
                pid=popen.pid,
                argv=self._redact(p.argv),
                log=p.log_path,
                addr=p.addr,
                gpus=p.gpus,
                create_time=procs.create_time(popen.pid),
            )
        )
        jobs.write(self.home, self.record)
        self.on_event("spawned", {"label": p.label, "pid": popen.pid, "argv": self._redact(p.argv)})

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.plan.health_timeout
        pending = [p for p in self.procs if p.plan.role == "server"]
        results: dict[str, bool] = {}

        def poll(proc: _Proc) -> None:
            delay = 0.005
            while not self.stop_requested.is_set() and time.monotonic() < deadline:
                if proc.exit_code() is not None:
                    return
                if probe_health(
                    proc.plan.host,
                    proc.plan.port,
                    proc.plan.health_path,
                    self.plan.api_key,
                    timeout=1.0,
                ):
                    results[proc.label] = True
                    return
                # Backoff capped near 100 ms: quick to notice readiness, cheap while loading.
                time.sleep(min(delay, 0.1))
                delay *= 2

        threads = {p.label: threading.Thread(target=poll, args=(p,), daemon=True) for p in pending}
        for t in threads.values():
            t.start()
        while pending:
            for proc in list(pending):
                code = proc.exit_code()
                if code is not None:
                    raise self._failure(proc, code, "while starting")
                if results.get(proc.label):
                    pending.remove(proc)
                    proc.healthy = True
                    self._register(proc)
                    self.on_event("healthy", {"label": proc.label, "addr": proc.plan.addr})
            if self.stop_requested.is_set():
                return
            if pending and time.monotonic() >= deadline:
                names = ", ".join(p.label for p in pending)
                raise WaitTimeout(
                    f"{names} not healthy after {self.plan.health_timeout:g}s",
                    hint="raise --health-timeout for big models, or read the log: "
                    + pending[0].plan.log_path,
                    detail=self._tail_text(pending[0]),
                )
            time.sleep(0.02)

    def _watch(self) -> int:
        trainers = [p for p in self.procs if p.plan.role == "trainer"]
        while not self.stop_requested.is_set():
            for proc in trainers:
                code = proc.exit_code()
                if code is not None:
                    proc.pump.join(timeout=2)
                    self._record_exit(proc, code)
                    self.on_event("trainer_exit", {"label": proc.label, "code": code})
                    if code != 0:
                        raise self._failure(proc, code, "")
                    return 0
            for proc in [p for p in self.procs if p.plan.role == "server" and not p.lost]:
                code = proc.exit_code()
                if code is not None:
                    proc.lost = True
                    self._deregister(proc)
                    self._record_exit(proc, code)
                    self.on_event(
                        "server_lost",
                        {
                            "label": proc.label,
                            "addr": proc.plan.addr,
                            "why": describe_exit(code),
                            "tail": list(proc.tail),
                        },
                    )
                    if not trainers and all(p.lost for p in self.procs if p.plan.role == "server"):
                        raise self._failure(proc, code, "(no replica left)")
            self.changed.wait()
            self.changed.clear()
        return EXIT_INTERRUPTED if self.stop_reason == "interrupted" else 0

    # -- registry, records, teardown -------------------------------------------------------

    def _register(self, proc: _Proc) -> None:
        p = proc.plan
        host = advertised_host(p.host)
        entry = ServerEntry(
            id=server_id(host, p.port),
            addr=f"{host}:{p.port}",
            experiment=self.plan.experiment,
            trial=self.plan.trial,
            backend=p.backend,
            model_path=self.plan.model_path,
            tp=self.plan.tp,
            gpus=p.gpus,
            host=settings.hostname(),
            pid=proc.popen.pid,
            pid_create_time=procs.create_time(proc.popen.pid),
            api_key_required=bool(self.plan.api_key),
            job=f"{self.plan.experiment}/{self.plan.trial}",
            marker=self.plan.marker,
        )
        try:
            self.registry.register(entry)
        except OSError as e:
            raise UsageError(
                f"cannot write the registry at {self.registry.url}: {e.strerror or e}",
                hint="pick a writable --registry (or AREAL_REGISTRY)",
            ) from None
        proc.registered = entry
        if self._beat is None:
            # From the first registration on, even while other replicas still load: an entry
            # whose heartbeat ages past its TTL counts as dead to every reader.
            self._beat = threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True)
            self._beat.start()

    def _heartbeat(self) -> None:
        while not self._finished.wait(HEARTBEAT_EVERY):
            for proc in list(self.procs):
                entry = proc.registered
                if entry is not None and not proc.lost:
                    try:
                        self.registry.keepalive(entry)
                    except OSError:
                        pass  # a full or flaky filesystem: the next beat tries again

    def _deregister(self, proc: _Proc) -> None:
        if proc.registered:
            e = proc.registered
            self.registry.deregister(self.plan.experiment, self.plan.trial, e.id, e.lease)
            proc.registered = None

    def _teardown(
        self, state: str, message: str | None, code: int, detail: str | None = None
    ) -> None:
        self._finished.set()
        self.on_event("stopping", {"state": state})
        for proc in self.procs:
            self._deregister(proc)
        # Reaped processes' pids may already belong to someone else: only live ones are roots.
        live = [p.popen.pid for p in self.procs if p.popen.poll() is None]
        procs.kill_job(self.plan.marker, live, grace=5.0)
        for proc in self.procs:
            try:
                proc.popen.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
            proc.pump.join(timeout=2)
            if proc.popen.returncode is not None:
                self._record_exit(proc, proc.popen.returncode, write=False)
        if self._reaper and self._reaper.poll() is None:
            self._reaper.terminate()
            try:
                self._reaper.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self._reaper.kill()
        if self.record:
            self.record.state = state
            self.record.message = message
            self.record.detail = detail
            self.record.exit_code = code
            jobs.write(self.home, self.record)
        self._slot.close()  # releases the slot's lock

    def _start_record(self) -> None:
        me = os.getpid()
        self.record = jobs.JobRecord(
            experiment=self.plan.experiment,
            trial=self.plan.trial,
            kind=self.plan.kind,
            state="starting",
            marker=self.plan.marker,
            supervisor_pid=me,
            supervisor_create_time=procs.create_time(me),
            host=settings.hostname(),
            started=time.time(),
            log_dir=self.plan.log_dir,
            registry=self.plan.registry,
            alloc=self.plan.alloc,
            model=self.plan.model_path,
            api_key_file=self.plan.api_key_file,
        )
        jobs.write(self.home, self.record)

    def _set_state(self, state: str) -> None:
        self.record.state = state
        jobs.write(self.home, self.record)

    def _record_exit(self, proc: _Proc, code: int, write: bool = True) -> None:
        for r in self.record.processes:
            if r.pid == proc.popen.pid:
                r.exit_code = code
        if write:
            jobs.write(self.home, self.record)

    def _start_reaper(self) -> None:
        me = os.getpid()
        env = {k: v for k, v in os.environ.items() if k != procs.MARKER_ENV}
        argv = [sys.executable, "-m", "areal_cli.reaper", "--parent", str(me)]
        argv += ["--marker", self.plan.marker, "--home", str(self.home)]
        argv += ["--experiment", self.plan.experiment, "--trial", self.plan.trial]
        argv += ["--registry", self.plan.registry]
        self._reaper = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _write_api_key(self) -> None:
        if self.plan.api_key and self.plan.api_key_file:
            path = Path(self.plan.api_key_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.plan.api_key)
            os.chmod(path, 0o600)

    def _redact(self, argv: list[str]) -> list[str]:
        key = self.plan.api_key
        return [("<api-key>" if key and a == key else a) for a in argv]

    # -- failure reports ------------------------------------------------------------------

    def _failure(self, proc: _Proc, code: int, when: str) -> LaunchError:
        proc.pump.join(timeout=2)
        label, tail, log = proc.label, self._tail_text(proc), proc.plan.log_path
        if proc.plan.role == "trainer":
            rank, rank_code = _root_cause(proc)
            if rank is not None:
                label = f"rank-{rank}"
                if rank_code is not None and rank_code != code:
                    when = f"{when} (torchrun exited {code})".strip()
                    code = rank_code
                log = os.path.join(os.path.dirname(proc.plan.log_path), f"rank-{rank}.log")
                tail = "\n".join(proc.rank_tails.get(rank, proc.tail))
        what = f"{label} failed {when}".strip()
        return LaunchError(f"{what}: {describe_exit(code)}", detail=tail, hint=f"full log: {log}")

    def _tail_text(self, proc: _Proc) -> str:
        return "\n".join(proc.tail) or "(no output)"


def _root_cause(proc: _Proc) -> tuple[int | None, int | None]:
    """torchrun's failure report names the first failing rank and its exit code:
    "rank : 1 (local_rank: 1)" then "exitcode : 5 (pid: 123)"."""
    text = "\n".join(proc.tail)
    head = max(text.rfind("Root Cause"), 0)
    m = re.search(r"\brank\s*:\s*(\d+)", text[head:])
    if m:
        code = re.search(r"exitcode\s*:\s*(-?\d+)", text[head + m.end() :])
        return int(m.group(1)), (int(code.group(1)) if code else None)
    failing = [
        r for r, t in proc.rank_tails.items() if any("Error" in x or "Traceback" in x for x in t)
    ]
    return (min(failing) if failing else None), None


def run_daemon(plan_path: str, home: str) -> int:
    """The body of a detached job: the same supervisor, logging to its own file."""
    plan = Plan.from_json(json.loads(Path(plan_path).read_text()))
    sup = Supervisor(plan, Path(home), on_event=_log_event)
    signal.signal(signal.SIGTERM, lambda *_: sup.request_stop("stopped by areal stop"))
    signal.signal(signal.SIGINT, lambda *_: sup.request_stop("interrupted"))
    try:
        return sup.run()
    except ArealError as e:
        print(f"error: {e.message}", flush=True)
        return e.exit_code


def _log_event(kind: str, info: dict) -> None:
    print(f"{time.strftime('%H:%M:%S')} {kind} {json.dumps(info, default=str)}", flush=True)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m areal_cli.supervisor")
    ap.add_argument("plan")
    ap.add_argument("--home", required=True)
    a = ap.parse_args()
    sys.exit(run_daemon(a.plan, a.home))
