"""The local scheduler's supervisor: run a plan's processes on this host, gate on readiness,
watch them, tear them down, and keep the job record. The job's life (servers ready → trainers
→ end, with server loss, restarts and the stop path) is the one every scheduler follows,
lifecycle.Lifecycle; the supervisor is its transport on this host, and keeps its own record,
reaper and teardown.

What it starts, each in a session of its own and carrying the job's marker:

    server-N   python -m areal_cli.launchers.replica PLAN --index N
               (starts the server, registers it when healthy, renews its lease)
    torchrun   python -m areal_cli.launchers.torchrun --log-dir D -- <torchrun argv>
               (one rank-N.log per rank, torchrun.log for its own lines)

Every process writes files; nothing waits on a pipe to the supervisor, so a suspended
supervisor (Ctrl-Z) stalls no server. A server counts as ready once its runner registered
it (an entry the runner signed). In the foreground the supervisor follows the log files for
the terminal.

The supervisor never prints. It reports through callbacks:
    on_event(kind, info)   "spawned" | "healthy" | "ready" | "server_lost" | "trainer_exit" |
                           "restart" (a restart of the trainers or a refusal: its line) |
                           "stopping" | "resumed" (servers a stopped trainer left paused)
    on_line(label, line)   a line of a log ("server-0", "rank-1", "torchrun")
and raises LaunchError (exit 1) or WaitTimeout (exit 3) for the first failure, root cause first.

With plan.max_restarts, a failed trainer group is started again in the same job (the servers
kept, AREAL_RESTART=<n> in its environment) when the doctor's root cause of the failure says a
restart may pass (diagnose.restart); each decision is one line: an event, the supervisor's log
and the job record (`areal ps`). The failed attempt's logs move to attempt-<n>/ of the log
folder, so that the next failure is diagnosed from its own attempt's logs only.

Run as `python -m areal_cli.schedulers.local.supervisor PLAN --home H --slot-fd N...` it is
the daemon behind --detach.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from areal_cli import apikeys, files, logfiles, procs, request_errors, settings
from areal_cli.diagnose import restart, targets, watchdog
from areal_cli.errors import EXIT_INTERRUPTED, ArealError, LaunchError, WaitTimeout
from areal_cli.launchers import torchrun
from areal_cli.launchers.replica import replica_processes
from areal_cli.registry import open_registry
from areal_cli.schedulers import lifecycle
from areal_cli.schedulers.api import EventFn, LineFn, Stopped
from areal_cli.schedulers.common import explain_failure, resume_left_paused, tail_text
from areal_cli.schedulers.local import records
from areal_cli.schedulers.local.launch import supervisor_log
from areal_cli.spec import Plan, ProcessPlan

EXIT_TERMINATED = 128 + signal.SIGTERM  # 143: stopped by SIGTERM (areal stop, timeout)
# Seconds the teardown waits for the registry to drop the job's entries.
REGISTRY_WAIT = 1.0
# Seconds between two looks at the job's registry entries while it runs: a replica runner
# registers the server it started again (a new pid) under a fresh entry, and the record follows.
FOLLOW_SERVERS_EVERY = 1.0


class _Proc:
    """One launched runner; a thread wakes the supervisor the moment it exits."""

    def __init__(self, plan: ProcessPlan, popen: subprocess.Popen, changed: threading.Event):
        self.plan = plan
        self.popen = popen

        def wait() -> None:
            popen.wait()
            changed.set()

        threading.Thread(target=wait, name=f"wait-{plan.label}", daemon=True).start()

    @property
    def label(self) -> str:
        return self.plan.label

    def exit_code(self) -> int | None:
        return self.popen.poll()


class Supervisor(lifecycle.Transport):
    """A job on this host, and its Lifecycle's transport: it spawns the processes, reads
    their readiness from the registry, observes them through their Popen objects, and ends
    them in its own teardown (which says "stopping" once, whatever ended the job)."""

    records = records
    # Seconds the ready wait gives beyond the health timeout: the runners run here.
    ready_slack = 10.0

    def __init__(
        self,
        plan: Plan,
        home: Path,
        claim: records.Claim,
        on_event: EventFn | None = None,
        on_line: LineFn | None = None,
        registry=None,
    ):
        super().__init__(plan, None, home)  # the record is made when the job starts
        self.claim = claim
        self.on_event = on_event or (lambda kind, info: None)
        self.on_line = on_line
        # In the foreground the registry the plan was made with; a daemon opens its own.
        self.registry = (
            registry
            if registry is not None and registry.url == plan.registry
            else open_registry(plan.registry)
        )
        self.procs: list[_Proc] = []
        self.stop_requested = threading.Event()
        self.changed = threading.Event()  # a process exited, or a stop was requested
        self.stop_reason: str | None = None
        self.stop_code = EXIT_INTERRUPTED
        self._reaper: subprocess.Popen | None = None
        self._follow_stop = threading.Event()
        self._follower: threading.Thread | None = None
        self.rec: records.JobRecord | None = None
        self._last_lost: int | None = None  # the replica lost last (a serving job's failure)
        self._watchdog = None  # diagnose.watchdog.Watchdog while trainers run
        self._stalled = None  # the stall that ends the job (--watchdog-action fail)
        self._servers_seen = 0.0  # monotonic time of the last look at the registry's entries

    # -- public ---------------------------------------------------------------------------

    def request_stop(self, reason: str = "interrupted", code: int = EXIT_INTERRUPTED) -> None:
        self.stop_reason, self.stop_code = reason, code
        self.stop_requested.set()
        self.changed.set()

    def supervise(self) -> int:
        """Run the job to its end. Returns the exit code; raises for the first failure."""
        settings.ensure_dir(self.plan.log_dir)
        # Entries left by servers that died with their supervisor and watchdog (a reboot):
        # AReaL's reader cannot tell them from live ones, so they go before we add ours.
        try:
            self.registry.prune(self.plan.experiment, self.plan.trial)
        except OSError:
            pass
        if self.plan.api_key and self.plan.api_key_file:
            apikeys.store(self.plan.api_key_file, self.plan.marker, self.plan.api_key)
        self._start_record()
        self._start_reaper()
        if self.on_line is not None:
            # Only this job's own logs: a training job shares its folder with the servers.
            roles = (("server",) if self.plan.servers else ()) + (
                lifecycle.TRAINER_ROLES if self.plan.trainers else ()
            )
            self._follower = logfiles.follow_in_background(
                Path(self.plan.log_dir), self._line, self._follow_stop, roles
            )
        error: ArealError | None = None
        code = 0
        try:
            code = self._run()
        except ArealError as e:
            error = e
            code = e.exit_code
        except BaseException as e:
            if not files.is_full(e):
                code = 1
                self._teardown("failed", "the supervisor crashed", 1)
                raise
            error = files.disk_full(getattr(e, "filename", None) or self.plan.log_dir, e)
            code = error.exit_code
        if error is not None:
            self._teardown("failed", error.message, code, error.detail)
            raise error
        state = "stopped" if code == 0 or self.stop_requested.is_set() else "failed"
        self._teardown(state, self.stop_reason, code)
        return code

    # -- phases ---------------------------------------------------------------------------

    def _run(self) -> int:
        life = lifecycle.Lifecycle(self, self.stop_requested, self.on_event)
        try:
            life.until_ready()
            for p in self.plan.trainers:
                self._spawn(p)
                self._set_state("running")
                self._record_rendezvous(self.procs[-1])
            self._start_watchdog()
            return life.until_end()
        except Stopped:
            if self._stalled is not None:
                raise self._watchdog_failure(self._stalled) from None
            return self.stop_code

    def _spawn(self, p: ProcessPlan, extra_env: dict[str, str] | None = None) -> None:
        settings.ensure_dir(Path(p.log_path).parent)
        env = {**os.environ, procs.MARKER_ENV: self.plan.marker, **(extra_env or {})}
        if p.role == "server":
            argv = [sys.executable, "-m", "areal_cli.launchers.replica"]
            argv += [str(self.claim.plan_file), "--index", str(p.index)]
        else:
            env.update(p.env)
            if p.env.get("CUDA_VISIBLE_DEVICES") == "":
                env["CUDA_VISIBLE_DEVICES"] = ""
            argv = [sys.executable, "-m", "areal_cli.launchers.torchrun"]
            argv += ["--log-dir", self.plan.log_dir, "--", *p.argv]
        try:
            popen = subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        except OSError as e:
            raise LaunchError(f"{p.label} could not start: {e}") from None
        self.procs.append(_Proc(p, popen, self.changed))
        self.rec.processes.append(
            records.ProcessRecord(
                role=p.role,
                index=p.index,
                pid=popen.pid,
                argv=self.plan.redact(p.argv),
                log=p.log_path,
                addr=p.addr,
                gpus=p.gpus,
                create_time=procs.create_time(popen.pid),
            )
        )
        records.write(self.home, self.rec)
        self.on_event("spawned", {"label": p.label, "pid": popen.pid})

    def _ours(self, listed: list) -> dict:
        """The plan's server address → the registry entry our runner made for it. The pid and
        address recorded from it are acted on later (ps, watchdog, teardown): only an entry our
        runner signed counts, not a copy another user planted."""
        key = self.plan.api_key
        return {_local_addr(e.addr, self.plan): e for e in listed
                if e.marker == self.plan.marker and (not key or not apikeys.unproven(key, e))}  # fmt: skip

    def _process_record(self, proc: _Proc) -> records.ProcessRecord:
        return next(r for r in self.rec.processes if r.pid == proc.popen.pid)

    def _follow_servers(self) -> None:
        """The record follows a server its runner started again (launchers/replica.py): the
        registry entry names the new pid, which `areal ps`, the watchdog's bundle and the
        teardown then use. A server that died and has no successor serving yet is recorded as
        none (its pid may be anyone's soon); one that only left discovery (it stopped
        answering /health) keeps its pid. At most once per FOLLOW_SERVERS_EVERY."""
        now = time.monotonic()
        if not self.plan.servers or now - self._servers_seen < FOLLOW_SERVERS_EVERY:
            return
        self._servers_seen = now
        try:
            ours = self._ours(self.registry.list(self.plan.experiment, self.plan.trial).servers)
        except (ArealError, OSError):
            return  # the registry is down for a moment: the record keeps what it had
        changed = False
        for i in sorted(set(self.life.ready) - self.life.lost):
            proc = self._server(i)
            if proc.exit_code() is not None:
                continue  # its runner ended: the replica is lost, the record keeps its pid
            rec, e = self._process_record(proc), ours.get(proc.plan.addr)
            now_serving = (e.pid, e.pid_create_time) if e is not None else None
            if now_serving and now_serving != (rec.server_pid, rec.server_create_time):
                rec.server_pid, rec.server_create_time = e.pid, e.pid_create_time
                changed = True
            elif (e is None and rec.server_pid
                  and not procs.pid_alive(rec.server_pid, rec.server_create_time)):  # fmt: skip
                rec.server_pid = rec.server_create_time = None
                changed = True
        if changed:
            try:
                records.write(self.home, self.rec)
            except ArealError:
                pass  # a full disk: the next change, or the end, is written when it can be

    def _live_servers(self) -> list[int]:
        """The recorded servers that still run: the same processes (by their create time),
        never a later owner of a pid, which the teardown would kill."""
        return [r.server_pid for r in self.rec.processes if r.role == "server" and r.server_pid
                and r.server_create_time
                and procs.pid_alive(r.server_pid, r.server_create_time)]  # fmt: skip

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
            rec = next(r for r in self.rec.processes if r.pid == proc.popen.pid)
            rec.addr = f"127.0.0.1:{port[0]}"
            records.write(self.home, self.rec)

    def _watchdog_failure(self, s) -> LaunchError:
        """The job's end when its watchdog stopped the trainers (--watchdog-action fail)."""
        return LaunchError(
            f"watchdog: {s.headline()}",
            detail=f"no rank progressed for {watchdog.stall_limit(s, self.plan.watchdog)}",
            hint=f"the stacks, flight recorder dumps and last log lines: {s.bundle}"
            + (f" (incomplete: {s.bundle_error})" if s.bundle_error else "")
            if s.bundle
            else f"no bundle was kept: {s.bundle_error}",
        )

    # -- the Lifecycle's transport --------------------------------------------------------

    @property
    def what(self) -> str:
        return f"job {self.plan.experiment}/{self.plan.trial}"

    def place(self) -> None:
        for p in self.plan.servers:
            self._spawn(p)

    def registered(self, pending: list[int]) -> dict[int, dict]:
        """The replicas whose runner registered its server (it does so once the server
        answers /health); the record takes the server's pid and where others reach it."""
        try:
            listed = self.registry.list(self.plan.experiment, self.plan.trial).servers
        except ArealError:
            return {}  # the registry is down for a moment; the runner keeps trying
        ours = self._ours(listed)
        found = {}
        for i in pending:
            e = ours.get(self.plan.servers[i].addr)
            if e is None:
                continue
            rec = self._process_record(self._server(i))
            rec.server_pid, rec.server_create_time = e.pid, e.pid_create_time
            rec.addr = e.addr  # where others reach it (a wildcard bind advertises an IP)
            records.write(self.home, self.rec)
            found[i] = {"addr": e.addr}
        return found

    def not_registered(self, pending: list[int]) -> WaitTimeout:
        first = self.plan.servers[pending[0]]
        return WaitTimeout(
            f"{', '.join(self.plan.servers[i].label for i in pending)} not registered after "
            f"{self.plan.health_timeout:g}s",
            hint=f"read the log: {first.log_path}",
            detail=tail_text(first.log_path),
        )

    def servers_ready(self) -> None:
        self.life.check_stop()  # a stop while they started: no trainer starts
        self._set_state("running")
        self.on_event("ready", {"servers": [p.addr for p in self.plan.servers]})

    def wait(self, seconds: float) -> None:
        # `changed` wakes it the moment a runner exits or a stop is asked. Bounded: a signal
        # the kernel hands to another thread (SIGINT right after a SIGCONT) runs its Python
        # handler only when this thread next wakes.
        self.changed.wait(seconds)
        self.changed.clear()

    def look(self) -> int | None:
        """The trainers: one that ended well ends the job; one that failed is restarted when
        the root cause allows (lifecycle.restart_trainers over these processes and record),
        else it is the failure. The record follows restarted servers."""
        for proc in self._trainers():
            code = proc.exit_code()
            if code is None:
                continue
            self._record_exit(proc, code)
            self.on_event("trainer_exit", {"label": proc.label, "code": code})
            if code == 0:
                return 0
            if not lifecycle.restart_trainers(self, self.plan, code, self.stop_requested):
                raise self._trainer_failure(proc, code)
            break
        self._follow_servers()
        return None

    def exit_code(self, label: str) -> int | None:
        return next((p.exit_code() for p in self.procs if p.label == label), None)

    def server_lost(self, index: int) -> None:
        proc = self._server(index)
        self._reap_replica(proc)
        self._record_exit(proc, proc.exit_code())
        self._last_lost = index

    def servers_gone(self) -> None:
        p = self.plan.servers[self._last_lost]
        code = self._server(self._last_lost).exit_code()
        raise lifecycle.failure(p.label, code, p.log_path, "(no replica left)")

    def cancel(self, reason: str) -> None:
        """Nothing here: the teardown that follows in supervise() ends the job and records
        why (the failure's message, or the stop's reason)."""

    def stopped(self, reason: str) -> None:
        """Nothing here either: the teardown says "stopping" and ends the job."""

    def _server(self, index: int) -> _Proc:
        return next(p for p in self.procs if p.plan.role == "server" and p.plan.index == index)

    def _trainers(self) -> list[_Proc]:
        return [p for p in self.procs if p.plan.role == "trainer"]

    # -- what a restart asks of the supervisor (lifecycle.Restarts) -----------------------

    def stop_trainers(self) -> None:
        self._stop_trainers(self._trainers())

    def decisions(self) -> list[dict]:
        return self.rec.restarts

    def start_trainers(self, attempt: int) -> None:
        """The failed group's records go; the group starts again, AREAL_RESTART=<n> in its
        environment, and its watchdog with it."""
        for proc in self._trainers():
            self.procs.remove(proc)
            self.rec.processes = [r for r in self.rec.processes if r.pid != proc.popen.pid]
        for p in self.plan.trainers:
            if self.stop_requested.is_set():  # Ctrl-C during the restart: the teardown is next
                break
            self._spawn(p, {restart.ENV: str(attempt)})
            self._record_rendezvous(self.procs[-1])
        self._start_watchdog()

    def _stop_trainers(self, old: list[_Proc]) -> None:
        """The failed group's processes, whatever is left: its launchers' trees and ranks that
        torchrun left behind (they carry the job's marker and torchrun's run id; servers do
        not)."""
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None
        left = procs.tree([p.popen.pid for p in old if p.popen.poll() is None])
        for p in procs.find_marked(self.plan.marker):
            try:
                if "TORCHELASTIC_RUN_ID" in p.environ():
                    left.append(p)
            except (OSError, psutil.Error):
                continue
        procs.terminate(left, grace=5.0)
        for p in old:
            try:
                p.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def tell(self, decision) -> None:
        """One line per decision: the event (the terminal, or the daemon's log), the job
        record (`areal ps`) and, in the foreground, the supervisor's log in the log folder."""
        self.rec.restarts.append({**decision.to_json(), "time": time.time()})
        try:
            records.write(self.home, self.rec)
        except ArealError:
            pass  # a full disk: the line is still said, and the end is recorded
        self.on_event("restart", decision.to_json())
        if self.on_line is None:
            return  # the daemon's events are its log already (run_daemon)
        try:
            fd = os.open(supervisor_log(self.plan),
                         os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)  # fmt: skip
            with os.fdopen(fd, "a") as f:
                f.write(f"{time.strftime('%H:%M:%S')} {decision.line}\n")
        except OSError:
            pass  # a full disk: the terminal and the record still have the line

    def _start_watchdog(self) -> None:
        """The watchdog of the trainers that run now (none with --watchdog 0)."""
        roots = [p.popen.pid for p in self._trainers()]
        if not roots or self.plan.watchdog <= 0:
            return
        name = f"{self.plan.experiment}/{self.plan.trial}"
        self._watchdog = watchdog.Watchdog(
            self.plan.watchdog,
            self.plan.log_dir,
            ranks=lambda: targets.under(roots, f"job {name}", name),
            on_stall=self._on_stall,
            server_pids=self._server_pids,
            refused=self._refused,
            auto=self.plan.watchdog_auto,
        )
        self._watchdog.start()

    def _refused(self) -> list[str]:
        """The servers the job uses that refuse their clients (request_errors.refusing): its
        trial's in the registry, and those of this host's serving jobs at the addresses its
        trainers were given."""
        trials = [(self.plan.experiment, self.plan.trial)]
        addrs = {a for p in self.plan.trainers for a in
                 p.env.get("AREAL_LLM_SERVER_ADDRS", "").split(",") if a}  # fmt: skip
        if addrs:
            recs, _bad = records.list_all(self.home)
            trials += [(rec.experiment, rec.trial) for rec in recs
                       if rec.state == "running" and any(p.addr in addrs for p in rec.processes)]  # fmt: skip
        return request_errors.refusals(self.plan.registry, trials, addrs or None)

    def _server_pids(self) -> list[int]:
        """The servers the job uses that run now: its own, and those of this host's serving
        jobs at the addresses its trainers were given (each supervisor's record follows its
        servers' restarts)."""
        pids = self._live_servers()
        addrs = {a for p in self.plan.trainers for a in
                 p.env.get("AREAL_LLM_SERVER_ADDRS", "").split(",") if a}  # fmt: skip
        if addrs:
            recs, _bad = records.list_all(self.home)
            for rec in recs:
                if rec.marker != self.plan.marker and rec.state == "running":
                    pids += [p.server_pid for p in rec.processes
                             if p.role == "server" and p.addr in addrs and p.server_pid
                             and procs.pid_alive(p.server_pid, p.server_create_time)]  # fmt: skip
        return pids

    def _on_stall(self, stall) -> None:
        line = watchdog.log_line(self.plan.log_dir, stall, self.plan.watchdog)
        self.rec.watchdog = stall.to_json()
        try:
            records.write(self.home, self.rec)
        except ArealError:
            pass  # a full disk: the verdict is still said and acted on; the end is recorded
        self.on_event("stall", {**stall.to_json(), "line": line})
        if self.plan.watchdog_action == "fail":
            self._stalled = stall
            self.request_stop(f"watchdog: {stall.headline()}", 1)

    # -- records, teardown ----------------------------------------------------------------

    def _reap_replica(self, proc: _Proc) -> None:
        """A runner that died without its server (SIGKILL, OOM) leaves the server behind:
        stop it and take its entry out of the registry."""
        left = replica_processes(self.plan.marker, proc.plan.index)
        if left:
            procs.terminate(left, grace=3.0)
        try:
            for e in self.registry.list(self.plan.experiment, self.plan.trial, True).servers:
                if (
                    e.marker == self.plan.marker
                    and _local_addr(e.addr, self.plan) == proc.plan.addr
                ):
                    self.registry.deregister(e.experiment, e.trial, e.id, e.lease)
        except (ArealError, OSError):
            pass

    def _line(self, label: str, line: str) -> None:
        # torchrun answers a stop with a SignalException traceback of its own: not news.
        if label.startswith("torchrun") and self.stop_requested.is_set():
            return
        self.on_line(label, line)

    def _teardown(
        self, state: str, message: str | None, code: int, detail: str | None = None
    ) -> None:
        self.on_event("stopping", {"state": state})
        if self._watchdog is not None:
            self._watchdog.close()
        # Reaped processes' pids may already belong to someone else: only live ones are roots.
        # The servers too: one whose runner was killed is in no runner's tree any more.
        live = [p.popen.pid for p in self.procs if p.popen.poll() is None]
        live += self._live_servers() if self.rec else []
        procs.kill_job(self.plan.marker, live, grace=5.0)
        self._resume_servers()
        for proc in self.procs:
            try:
                proc.popen.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
            if proc.popen.returncode is not None:
                self._record_exit(proc, proc.popen.returncode, write=False)
        # Runners deregister their own servers; this catches a runner that was killed. A
        # registry that does not answer gets a short wait: the entries' leases run out anyway,
        # and `areal stop` names what is left.
        cleanup = threading.Thread(target=self._deregister_job, daemon=True)
        cleanup.start()
        cleanup.join(REGISTRY_WAIT)
        self._follow_stop.set()
        if self._follower is not None:
            self._follower.join(timeout=2)
        if self._reaper and self._reaper.poll() is None:
            self._reaper.terminate()
            try:
                self._reaper.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self._reaper.kill()
        if self.rec:
            self.rec.state = state
            self.rec.message = message
            self.rec.detail = detail
            self.rec.exit_code = code
            records.write(self.home, self.rec)
        self.claim.release()

    def _deregister_job(self) -> None:
        try:
            self.registry.deregister_job(self.plan.experiment, self.plan.trial, self.plan.marker)
        except (ArealError, OSError):
            pass

    def _resume_servers(self) -> None:
        resumed = resume_left_paused(self.plan)
        if resumed:
            self.on_event("resumed", {"servers": resumed})

    def _start_record(self) -> None:
        me = os.getpid()
        self.rec = records.JobRecord(
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
        records.write(self.home, self.rec)

    def _set_state(self, state: str) -> None:
        self.rec.state = state
        records.write(self.home, self.rec)

    def _record_exit(self, proc: _Proc, code: int, write: bool = True) -> None:
        for r in self.rec.processes:
            if r.pid == proc.popen.pid:
                r.exit_code = code
        if write:
            records.write(self.home, self.rec)

    def _start_reaper(self) -> None:
        me = os.getpid()
        env = {k: v for k, v in os.environ.items() if k != procs.MARKER_ENV}
        argv = [sys.executable, "-m", "areal_cli.schedulers.local.reaper", "--parent", str(me)]
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

    # -- failure reports ------------------------------------------------------------------

    def _trainer_failure(self, proc: _Proc, code: int) -> LaunchError:
        """The trainers failed: the rank torchrun's report names, with its own exit code."""
        label, log, when = proc.label, proc.plan.log_path, ""
        rank, rank_code, died_of, hint, _ = explain_failure(Path(self.plan.log_dir), [log])
        if rank is not None:
            label = f"rank-{rank}"
            if rank_code is not None and rank_code != code:
                when = f"(torchrun exited {code})"
                code = rank_code
            log = os.path.join(self.plan.log_dir, f"rank-{rank}.log")
        return lifecycle.failure(label, code, log, when, died_of, hint)


def _local_addr(addr: str, plan: Plan) -> str:
    """A registered address (advertised host) as the plan names it (bind host)."""
    port = addr.rpartition(":")[2]
    for p in plan.servers:
        if str(p.port) == port:
            return p.addr
    return addr


def run_daemon(plan_path: str, home: str, slot_fds: list[int]) -> int:
    """The body of a detached job: the same supervisor, logging its events to its own file."""
    plan = Plan.from_json(json.loads(Path(plan_path).read_text()))
    claim = records.Claim.inherited(slot_fds, Path(plan_path))
    sup = Supervisor(plan, Path(home), claim, on_event=_log_event)
    signal.signal(
        signal.SIGTERM, lambda *_: sup.request_stop("stopped by areal stop", EXIT_TERMINATED)
    )
    signal.signal(signal.SIGINT, lambda *_: sup.request_stop("interrupted"))
    try:
        return sup.supervise()
    except ArealError as e:
        print(f"error: {e.message}", flush=True)
        return e.exit_code


def _log_event(kind: str, info: dict) -> None:
    if kind == "restart":  # its own line, as the foreground's supervisor log has it
        print(f"{time.strftime('%H:%M:%S')} {info['line']}", flush=True)
        return
    print(f"{time.strftime('%H:%M:%S')} {kind} {json.dumps(info, default=str)}", flush=True)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m areal_cli.schedulers.local.supervisor")
    ap.add_argument("plan")
    ap.add_argument("--home", required=True)
    ap.add_argument("--slot-fd", type=int, action="append", required=True)
    a = ap.parse_args()
    sys.exit(run_daemon(a.plan, a.home, a.slot_fd))
