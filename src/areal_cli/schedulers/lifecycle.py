"""One job's life as the `areal` that started it follows it, the same on every scheduler
(local, Slurm, Ray):

    placed → servers ready → trainers (restarted by the doctor's root cause) → end → teardown

with the watchdog's verdict and the stop path (Ctrl-C → 130, SIGTERM → 143, the job cancelled).
What differs is the Transport each scheduler supplies: how its processes are placed and
started, where their readiness shows (a cluster job's ready files, the registry entries the
local runners signed), how the job is observed (squeue, Ray's actors, the local processes),
how trainers are stopped and started again, and how the job is ended. The local supervisor is
its own transport; its teardown (the job's processes, the record, the slot) stays its own.
The Lifecycle keeps the state they share (the servers that registered, the replicas lost) and
says what happens through the scheduler's callbacks:

    on_event(kind, info)  "healthy" | "ready" | "server_lost" | "trainer_exit" | "restart" |
                          "stopping" (and what a transport adds: "running", "submitted")
    on_progress(text)     a line that replaces the last one while waiting

It raises LaunchError (exit 1), WaitTimeout (exit 3) or Stopped, root cause first.

The run folder's watchdog files are read here too: the job's own watchdog (in the batch job,
or in the first training node's actor) leaves its last stall in STALL_FILE, and FAIL_FILE when
`--watchdog-action fail` ended the trainers.
"""

from __future__ import annotations

import json
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Protocol

from areal_cli import files, logfiles
from areal_cli.diagnose import restart
from areal_cli.errors import EXIT_TIMEOUT, ArealError, LaunchError, WaitTimeout
from areal_cli.schedulers.api import EventFn, LineFn, Stopped
from areal_cli.schedulers.cluster import follow_logs, read_code
from areal_cli.schedulers.common import describe_exit, explain_failure, tail_text

STALL_FILE = "watchdog.json"
FAIL_FILE = "watchdog.fail"
# The log roles followed in the foreground besides the servers'.
TRAINER_ROLES = ("rank", "torchrun", "watchdog")


def read_stall(run_dir: str | Path) -> dict | None:
    """The last stall the job's watchdog diagnosed, as it left it in the run folder."""
    try:
        return json.loads((Path(run_dir) / STALL_FILE).read_text())
    except (OSError, ValueError):
        return None


def failed_by_watchdog(run_dir: str | Path) -> dict | None:
    """The stall that ended the job (--watchdog-action fail), or None."""
    if not (Path(run_dir) / FAIL_FILE).exists():
        return None
    return read_stall(run_dir)


def headline(stall: dict) -> str:
    odd = stall.get("odd_ranks") or []
    odd_s = f" (odd ranks {','.join(map(str, odd))})" if odd else ""
    return f"{stall.get('kind') or 'no verdict'}{odd_s}: {stall.get('summary') or ''}"


def watchdog_failure(stalled: dict, message: str) -> LaunchError:
    """The job's end when its watchdog stopped the trainers: the verdict, then where its
    bundle is."""
    return LaunchError(
        message,
        detail=f"no rank progressed for {stalled.get('seconds', 0):g}s",
        hint=f"the stacks, flight recorder dumps and last log lines: {stalled.get('bundle')}",
    )


def failure(
    label: str, code: int, log: str, when: str = "", died_of: str | None = None,
    hint: str | None = None,
) -> LaunchError:  # fmt: skip
    """`label` ended with `code` (`when`: "while starting", "(no replica left)"): what it died
    of, root cause first (a full filesystem under its log before all), its log's last lines and
    where the whole log is."""
    full = files.full_filesystem(log)
    if full:  # its output could not be written: that is what it died of, most likely
        died_of = f"the filesystem of its log is full: {full}" + (f"; {died_of}" if died_of else "")
        hint = "free space there, or point AREAL_HOME (--home) at a filesystem with room"
    what = f"{label} failed {when}".strip()
    died_of = f"; {died_of}" if died_of else ""
    return LaunchError(f"{what}: {describe_exit(code)}{died_of}", detail=tail_text(log),
                       hint=f"full log: {log}" + (f"; {hint}" if hint else ""))  # fmt: skip


def start_failure(label: str, code: int, log: str, health_timeout: float) -> ArealError:
    """A replica ended before it was ready: its health gate timed out (exit 3), or it failed."""
    if code == EXIT_TIMEOUT:
        return WaitTimeout(
            f"{label} not healthy after {health_timeout:g}s",
            detail=tail_text(log),
            hint=f"raise --health-timeout for big models, or read the log: {log}",
        )
    return failure(label, code, log, "while starting")


def trainer_failure(
    log_dir: str | Path, code: int, fallback_log: str, rank_node: Callable[[int], str | None]
) -> LaunchError:
    """The training nodes' torchrun ended with `code`: the rank that failed first, where it
    ran (`rank_node`, else what its report says) and what it died of, root cause first; when
    no rank is named, torchrun's own log (or `fallback_log`)."""
    log_dir = Path(log_dir)
    logs = sorted(str(p) for p in log_dir.glob("torchrun-*.log"))
    rank, rank_code, died_of, hint, node = explain_failure(log_dir, logs)
    if rank is None:
        return failure("torchrun", code, logs[0] if logs else fallback_log)
    node = rank_node(rank) or node
    where = f" on node {node}" if node else ""
    return failure(f"rank-{rank}{where}", rank_code if rank_code is not None else code,
                   str(log_dir / f"rank-{rank}.log"), died_of=died_of, hint=hint)  # fmt: skip


class Restarts(Protocol):
    """What a restart of the trainers asks of the side that runs them (a cluster transport,
    the local supervisor)."""

    def stop_trainers(self) -> None: ...
    def start_trainers(self, attempt: int) -> None: ...
    def decisions(self) -> list[dict]: ...
    def tell(self, decision: restart.Decision) -> None: ...


def restart_trainers(
    side: Restarts, plan, code: int, stop: threading.Event, logs: list[str] | tuple = ()
) -> bool:
    """The trainers failed with `code`: with --max-restarts, the doctor's root cause of the
    attempt decides (diagnose.restart; `logs`: the training nodes' torchrun logs); a restart
    archives the attempt's logs and starts the trainers again in the same job, AREAL_RESTART=
    <n> in their environment. Each decision is one line (side.tell). True when the trainers
    run again, or a stop came meanwhile."""
    if plan.max_restarts <= 0 or stop.is_set():
        return False
    # The rest of the group first: its lines end in the logs the doctor reads.
    side.stop_trainers()
    past = side.decisions()
    failure = restart.diagnose(plan.log_dir, logs, exit_what=describe_exit(code))
    decision = restart.decide(
        failure, sum(1 for d in past if d.get("restart")), plan.max_restarts, plan.restart_on,
        restart.previous_failure(past),
    )  # fmt: skip
    side.tell(decision)
    if stop.is_set():
        return True  # Ctrl-C or areal stop during the restart: the stop ends the job
    if not decision.restart:
        return False
    restart.archive_logs(plan.log_dir, decision.attempt)
    side.start_trainers(decision.attempt)
    return True


class Transport(ABC):
    """How one scheduler places, starts, observes and ends one job's processes. The Lifecycle
    that drives it is `self.life` (its state: ready servers, lost replicas, the stop). What
    the defaults read is a cluster job's run folder (`self.run`)."""

    records: ModuleType  # the scheduler's job records (load, write)
    poll_every = 0.5  # seconds between two looks at a running job
    # Seconds the ready wait gives beyond the health timeout (a cluster job's replicas start
    # on nodes that may still be setting up).
    ready_slack = 30.0

    def __init__(self, plan, rec, home: Path):
        self.plan, self.rec, self.home = plan, rec, home
        self.life: Lifecycle

    @property
    def run(self) -> Path:
        """The job's run folder: its runners' exit codes, ready files and restart log."""
        return Path(self.plan.run_dir)

    @property
    @abstractmethod
    def what(self) -> str:
        """The job as messages name it ("Slurm job 12")."""

    @abstractmethod
    def place(self) -> None:
        """Until the job's processes are placed and started; raises on a failure, a timeout
        (the job cancelled) and a stop."""

    def registered(self, pending: list[int]) -> dict[int, dict]:
        """Of the replicas `pending`, those registered now → what their runner said of them
        ("addr", "node"): its server-N.ready file."""
        found = {}
        for i in pending:
            try:
                found[i] = json.loads((self.run / f"server-{i}.ready").read_text())
            except (OSError, ValueError):
                continue
        return found

    def not_registered(self, pending: list[int]) -> WaitTimeout:
        """The ready wait is over with replicas `pending` still unregistered."""
        return WaitTimeout(
            f"{len(pending)} server(s) of {self.what} not registered after "
            f"{self.plan.health_timeout:g}s",
            hint=f"areal logs {self.rec.name} --role server",
        )

    def servers_ready(self) -> None:
        """Every replica registered: the record says the job runs, the event says where."""
        if self.plan.servers:
            self.rec.state = "running"
            self.records.write(self.home, self.rec)
            ready = self.life.ready
            self.life.on_event("ready", {"servers": [ready[i]["addr"] for i in sorted(ready)]})

    def wait(self, seconds: float) -> None:
        """Between two looks; a stop wakes it at once."""
        self.life.stop.wait(seconds)

    def look_starting(self) -> None:
        """One look while the servers start: raises when the job ended or was killed."""
        return None

    @abstractmethod
    def look(self) -> int | None:
        """One look at the running job: its exit code once it ended (0 when it ended well;
        raises LaunchError, root cause first), else None."""

    def check_stop(self) -> None:
        """A stop asked elsewhere (`areal stop` from another shell) that this areal reports."""
        return None

    def server_lost(self, index: int) -> None:
        """A ready replica ended: what is left of it goes."""
        return None

    def servers_gone(self) -> None:
        """Every replica of a serving job ended (a job that ends by itself then says so in
        `look`)."""
        return None

    @abstractmethod
    def cancel(self, reason: str) -> None:
        """End the job now; its record says why."""

    def stopped(self, reason: str) -> None:
        """A stop asked of this process: said, and the job cancelled."""
        self.life.on_event("stopping", {"state": "stopped"})
        self.cancel(reason)

    def exit_code(self, label: str) -> int | None:
        """A runner's exit code, once it ended (its file in the run folder)."""
        return read_code(self.run / f"{label}.exit")

    # -- restarts by this areal (the transports whose job cannot restart its trainers) -----

    def stop_trainers(self) -> None:
        raise NotImplementedError

    def start_trainers(self, attempt: int) -> None:
        raise NotImplementedError

    def decisions(self) -> list[dict]:
        """The restart decisions made so far: RUN/restarts.jsonl (`areal ps` reads it)."""
        return restart.read_log(self.run)

    def tell(self, decision: restart.Decision) -> None:
        """One line per decision: the event, RUN/restarts.jsonl and the log folder's
        supervisor-train.log."""
        try:
            restart.append_log(self.run, decision)
            with open(Path(self.plan.log_dir) / "supervisor-train.log", "a") as f:
                f.write(f"{time.strftime('%H:%M:%S')} {decision.line}\n")
        except OSError:
            pass  # a full disk: the event still says it
        self.life.on_event("restart", decision.to_json())


class Lifecycle:
    """Follows one job over its transport: until_ready, until_end, cancel, close."""

    def __init__(self, transport: Transport, stop: threading.Event,
                 on_event: EventFn | None = None, on_line: LineFn | None = None,
                 on_progress=None):  # fmt: skip
        self.t = transport
        transport.life = self
        self.plan = transport.plan
        self.stop = stop
        self.on_event = on_event or (lambda kind, info: None)
        self.on_progress = on_progress or (lambda text: None)
        self.stop_code = 130
        self.ready: dict[int, dict] = {}
        self.lost: set[int] = set()
        self._told = 0  # the restart decisions made in the job already told
        self._follow_stop = threading.Event()
        self._follower = None
        if on_line is not None:
            self._follower = follow_logs(self.plan, on_line, self._follow_stop, TRAINER_ROLES)

    # -- phases ---------------------------------------------------------------------------

    def until_ready(self) -> None:
        """Until the job runs and every server replica registered; raises on a failure, on a
        timeout (the job cancelled) and on a stop (Stopped, the job cancelled)."""
        self.t.place()
        n = len(self.plan.servers)
        deadline = time.monotonic() + self.plan.health_timeout + self.t.ready_slack
        while len(self.ready) < n:
            self.check_stop()
            self._read_ready()
            failed = next((i for i in range(n) if i not in self.ready
                           and self.t.exit_code(f"server-{i}") is not None), None)  # fmt: skip
            if failed is not None:
                self._fail(failed)
            self.t.look_starting()
            if time.monotonic() > deadline:
                self.cancel("not ready in time")
                raise self.t.not_registered([i for i in range(n) if i not in self.ready])
            if len(self.ready) < n:
                self.t.wait(0.05)  # a stop wakes it at once; check_stop then raises
        self.t.servers_ready()

    def until_end(self) -> int:
        """Follow the job to its end (a stop cancels it). Returns 0 when it ended well; raises
        LaunchError (root cause first) or Stopped."""
        while True:
            self.check_stop()
            code = self.t.look()
            if code is not None:
                return code
            self._servers_lost()
            if (
                not self.plan.trainers
                and self.plan.servers
                and (len(self.lost) == len(self.plan.servers))
            ):
                self.t.servers_gone()
            self.t.wait(self.t.poll_every)

    def cancel(self, reason: str) -> None:
        self.t.cancel(reason)

    def close(self) -> None:
        self._follow_stop.set()
        if self._follower is not None:
            self._follower.join(timeout=2)

    # -- the stop path --------------------------------------------------------------------

    def check_stop(self) -> None:
        """A stop asked of this process (Ctrl-C, SIGTERM): the job is cancelled, Stopped."""
        if self.stop.is_set():
            self.t.stopped("interrupted" if self.stop_code == 130 else "terminated")
            raise Stopped(self.stop_code)
        self.t.check_stop()

    # -- restarts -------------------------------------------------------------------------

    def restart(self, code: int) -> bool:
        """The trainers failed with `code`: restart_trainers over this job's transport."""
        logs = sorted(str(p) for p in Path(self.plan.log_dir).glob("torchrun-*.log"))
        return restart_trainers(self.t, self.plan, code, self.stop, logs)

    def tell_restarts(self) -> None:
        """The restart decisions the job made itself (its run folder's log), each once."""
        log = restart.read_log(self.t.run)
        for d in log[self._told :]:
            self.on_event("restart", d)
        self._told = len(log)

    # -- pieces ---------------------------------------------------------------------------

    def _read_ready(self) -> None:
        pending = [i for i in range(len(self.plan.servers)) if i not in self.ready]
        for i, info in sorted(self.t.registered(pending).items()):
            self.ready[i] = info
            # The node where a transport knows it (a cluster's ready file), as it said it.
            where = {"node": info["node"]} if "node" in info else {}
            self.on_event("healthy", {"label": f"server-{i}", "addr": info["addr"], **where})
            self.on_progress(f"{len(self.ready)}/{len(self.plan.servers)} server(s) registered")

    def _fail(self, i: int) -> None:
        """A replica ended before it was ready: the start failed, root cause first."""
        code = self.t.exit_code(f"server-{i}")
        self.cancel(f"server-{i} failed while starting")
        raise start_failure(f"server-{i}", code, self.plan.servers[i].log_path,
                            self.plan.health_timeout)  # fmt: skip

    def _servers_lost(self) -> None:
        for i in sorted(set(self.ready) - self.lost):
            code = self.t.exit_code(f"server-{i}")
            if code is None:
                continue
            self.lost.add(i)
            self.t.server_lost(i)
            self.on_event(
                "server_lost",
                {"label": f"server-{i}", "addr": self.ready[i]["addr"],
                 "why": describe_exit(code),
                 "tail": logfiles.tail(self.plan.servers[i].log_path, 20)},
            )  # fmt: skip
