"""Python stacks of live processes, taken with `py-spy dump --json`, one py-spy per process,
many at once (`default_workers`).

py-spy pauses a process for a few milliseconds, reads its interpreter state from outside and
lets it go: nothing has to be installed in the target, which is the whole point for a job that
is already hung.

Beside each dump the kernel's scheduler counters of every Python thread are kept
(/proc/PID/task/TID/schedstat: CPU time and how often the thread was scheduled in). Between two
samples they say, without attaching, whether a thread ran at all: a thread that did not run
cannot have moved, so its last dump still holds and is not taken again; a thread blocked in a
collective that was woken again and again has been finishing collectives.

A process in another PID namespace (a container, `unshare --pid`) knows its threads by the
namespace's ids, and py-spy reports those; /proc here knows them by this namespace's ids.
Every thread id of a dump is turned into ours (NSpid in /proc/PID/task/*/status) before
anything looks it up, and py-spy's on-CPU flag, which it could not match either, is taken
from the kernel's thread states. Native unwinding needs py-spy to ptrace each thread by the id
it knows, so `--native` runs py-spy inside the target's PID namespace (nsenter, with a /proc
of that namespace).
"""

from __future__ import annotations

import atexit
import os
import select
import signal
import sys
import threading
import time

from areal_cli.errors import UsageError

# `doctor hang` imports this module before its first py-spy starts: what a finished dump needs
# (dataclasses, json: diagnose.dumps) is imported once one has finished, meanwhile.
TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from areal_cli.diagnose.dumps import Dump, ThreadStack

DEFAULT_TIMEOUT = 10.0
MIN_WORKERS = 16  # py-spy processes at once, however few the CPUs: see default_workers
Counters = dict[int, tuple[int, int]]  # thread id -> (CPU ns, times scheduled in)

_DUMPS = ("Frame", "ThreadStack", "Dump", "parse_pyspy_json", "with_source")


def __getattr__(name: str):
    # stacks.Dump and the others, from the module that holds them (imported on first use).
    if name in _DUMPS:
        return getattr(_dumps(), name)
    raise AttributeError(f"module 'areal_cli.diagnose.stacks' has no attribute {name!r}")


def _dumps():
    from areal_cli.diagnose import dumps

    return dumps


def _new_dump(*args, **kwargs) -> Dump:
    return _dumps().Dump(*args, **kwargs)


def _replace(obj, **changes):
    from dataclasses import replace

    return replace(obj, **changes)


def _parse(text: str) -> list[ThreadStack]:
    return _dumps().parse_pyspy_json(text)


# --------------------------------------------------------------------------- py-spy itself


def find_pyspy() -> str | None:
    """py-spy next to this interpreter (the venv's bin/) first, then PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.path.isfile(here) and os.access(here, os.X_OK):
        return here
    import shutil

    return shutil.which("py-spy")


def require_pyspy() -> str:
    exe = find_pyspy()
    if exe is None:
        raise UsageError(
            "py-spy is not installed next to this Python nor on PATH",
            hint=f"{sys.executable} -m pip install py-spy",
        )
    return exe


def pyspy_version(exe: str) -> tuple[int, ...] | None:
    try:
        res = _run([exe, "--version"], 5.0)
    except (OSError, TimeoutExpired):
        return None
    # "py-spy 0.4.3"
    parts = res.stdout.strip().split()
    if len(parts) < 2:
        return None
    try:
        return tuple(int(x) for x in parts[-1].split(".")[:3])
    except ValueError:
        return None


def _pyspy_env() -> dict[str, str]:
    env = dict(os.environ)
    # A global RUST_BACKTRACE=1 makes py-spy symbolize and print its own backtrace on every
    # error: slower, and it buries the one line that says what went wrong.
    env["RUST_BACKTRACE"] = "0"
    return env


# --------------------------------------------------------------------------- dumping


def dump(
    pid: int,
    *,
    pyspy: str,
    native: bool = False,
    show_locals: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
) -> Dump:
    state, ids = _proc_status(pid)
    ns = pid_namespace(pid, ids)
    # A stopped process cannot be paused by ptrace (py-spy fails "Failed to get stack traces"),
    # and needs no pausing: it does not run, so reading it as it runs is exact.
    stopped = state == "T"
    native = native and not stopped
    before: dict[int, str] = {}
    if ns is not None and not native:
        # Read before py-spy stops the threads: what py-spy would have read itself.
        before = thread_states(pid, ns.values())
    argv = _dump_argv(pid, ns, pyspy, stopped=stopped, native=native, show_locals=show_locals)
    if isinstance(argv, str):
        return _new_dump(pid, error=argv, error_kind="namespace", taken_at=time.time())
    start = time.monotonic()
    taken_at = time.time()
    try:
        res = _run(argv, timeout)
    except TimeoutExpired:
        return _new_dump(
            pid,
            error=f"py-spy did not answer within {timeout:g}s",
            error_kind="timeout",
            taken_at=taken_at,
            elapsed_s=time.monotonic() - start,
        )
    except OSError as e:
        return _new_dump(
            pid, error=f"cannot run py-spy: {e}", error_kind="failed", taken_at=taken_at
        )
    elapsed = time.monotonic() - start
    return _read_dump(pid, res, ns, before, stopped=stopped, taken_at=taken_at, elapsed=elapsed)


def _dump_argv(
    pid: int, ns: dict[int, int] | None, pyspy: str, *, stopped: bool, native: bool,
    show_locals: bool,
) -> list[str] | str:  # fmt: skip
    """py-spy's command line for one dump, or why it cannot be run (a native dump of a process
    in another PID namespace without the tools to enter it)."""
    argv = [pyspy, "dump", "--json", "--pid", str(pid)]
    if stopped:
        argv.append("--nonblocking")
    if ns is not None and native:
        argv = _in_namespace(pid, ns, argv)
        if isinstance(argv, str):
            return argv
    if native:
        argv.append("--native")
    if show_locals:
        argv.append("--locals")
    return argv


def _read_dump(
    pid: int, res, ns: dict[int, int] | None, before: dict[int, str], *, stopped: bool,
    taken_at: float, elapsed: float,
) -> Dump:  # fmt: skip
    """The dump py-spy's finished run gives: its threads (by our thread ids), or its error."""
    if res.returncode != 0 or not res.stdout.strip():
        kind = classify_error(res.stderr, pid)
        message = _first_error_line(res.stderr) or f"py-spy exited with {res.returncode}"
        if kind == "gone":
            message = "the process exited while it was being dumped"
        return _new_dump(
            pid,
            error=message,
            error_kind=kind,
            taken_at=taken_at,
            elapsed_s=elapsed,
            stopped=stopped,
        )
    try:
        threads = _parse(res.stdout)
    except ValueError as e:
        return _new_dump(
            pid,
            raw=res.stdout,
            error=f"unreadable py-spy output: {e}",
            error_kind="failed",
            taken_at=taken_at,
            elapsed_s=elapsed,
        )
    if ns is not None:
        threads = _to_our_ids(threads, {**ns, **(pid_namespace(pid) or {})}, before)
    return _new_dump(
        pid,
        threads=threads,
        raw=res.stdout,
        taken_at=taken_at,
        elapsed_s=elapsed,
        stopped=stopped,
    )


def is_stopped(pid: int) -> bool:
    """Stopped by a signal (SIGSTOP, SIGTSTP: state T), not merely traced for a moment."""
    return _thread_state(pid, pid) == "T"


_running: set[int] = set()  # py-spy processes (their process groups) under way
_running_lock = threading.Lock()


def _kill_running() -> None:
    with _running_lock:
        pids = list(_running)
    for pid in pids:
        try:
            os.killpg(pid, 9)
        except OSError:
            pass


class TimeoutExpired(Exception):
    """py-spy did not finish within its timeout (it was killed)."""


class Ran:
    """What `_run` returns: exit status and output, as subprocess.CompletedProcess has them."""

    __slots__ = ("argv", "returncode", "stdout", "stderr")

    def __init__(self, argv: list[str], returncode: int, stdout: str, stderr: str) -> None:
        self.argv, self.returncode, self.stdout, self.stderr = argv, returncode, stdout, stderr


def _run(argv: list[str], timeout: float) -> Ran:
    """Run py-spy (or nsenter holding it) in its own session and process group: a timeout (or
    Ctrl-C) kills the whole group, so no py-spy outlives the nsenter that forked it.

    posix_spawn and one poll over both pipes rather than subprocess: the doctor starts one
    py-spy per rank from several threads, and subprocess's import and its Python-level
    communicate() were a share of a 16-rank dump that the GIL made the threads take in turn.
    """
    out_r, out_w = os.pipe()  # not inheritable: only the dup2'd copies reach py-spy
    err_r, err_w = os.pipe()
    try:
        pid = os.posix_spawnp(
            argv[0],
            argv,
            _pyspy_env(),
            file_actions=[(os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2)],
            setsid=True,
            # Python ignores these; an ignored signal would stay ignored in py-spy.
            setsigdef=(signal.SIGPIPE, signal.SIGXFSZ),
        )
    except BaseException:
        for fd in (out_r, out_w, err_r, err_w):
            os.close(fd)
        raise
    with _running_lock:
        _running.add(pid)
    os.close(out_w)
    os.close(err_w)
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    poller = select.poll()
    for fd in chunks:
        poller.register(fd, select.POLLIN)
    open_fds = set(chunks)
    deadline = time.monotonic() + timeout
    try:
        while open_fds:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutExpired(f"{argv[0]} did not finish within {timeout:g}s")
            for fd, _event in poller.poll(left * 1000):
                data = os.read(fd, 1 << 16)
                if data:
                    chunks[fd].append(data)
                else:
                    poller.unregister(fd)
                    open_fds.discard(fd)
        _, status = os.waitpid(pid, 0)
    except BaseException:
        try:
            os.killpg(pid, 9)
        except OSError:
            pass
        os.waitpid(pid, 0)
        raise
    finally:
        with _running_lock:
            _running.discard(pid)
        os.close(out_r)
        os.close(err_r)
    return Ran(
        argv,
        os.waitstatus_to_exitcode(status),
        b"".join(chunks[out_r]).decode(errors="replace"),
        b"".join(chunks[err_r]).decode(errors="replace"),
    )


# --------------------------------------------------------------------------- PID namespaces


def pid_namespace(pid: int, ids: list[int] | None = None) -> dict[int, int] | None:
    """None when `pid` runs in this /proc's PID namespace; else each of its threads' id in its
    own (innermost) namespace -> the id here. A thread that exits meanwhile is left out.
    `ids`: the process's NSpid, when read already (`_proc_status`)."""
    if ids is None:
        ids = _nspid(f"/proc/{pid}/status")
    if len(ids) < 2:
        return None
    out: dict[int, int] = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {ids[-1]: ids[0]}
    for tid in tasks:
        t = _nspid(f"/proc/{pid}/task/{tid}/status")
        if t:
            out[t[-1]] = t[0]
    return out


def _proc_status(pid: int) -> tuple[str, list[int]]:
    """The process's state letter ("X" when gone) and its NSpid (its id in each PID namespace,
    the innermost last), from one read of /proc/PID/status: a dump starts after it."""
    state, ids = "X", []
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            text = f.read()
        for line in text.splitlines():
            if line.startswith(b"State:"):
                state = line.split()[1].decode()
            elif line.startswith(b"NSpid:"):
                ids = [int(x) for x in line.split()[1:]]
                break
    except (OSError, ValueError, IndexError):
        pass
    return state, ids


def _nspid(path: str) -> list[int]:
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.startswith(b"NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return []


def thread_states(pid: int, tids: Iterable[int]) -> dict[int, str]:
    return {tid: _thread_state(pid, tid) for tid in tids}


def _in_namespace(pid: int, ns: dict[int, int], argv: list[str]) -> list[str] | str:
    """`argv` run inside the PID namespace of `pid`, with a /proc of that namespace in a mount
    namespace of its own (the rest of this host's files stay visible: py-spy itself), and
    naming the target by its id there; or why that cannot be done."""
    inner = next((n for n, ours in ns.items() if ours == pid), None)
    import shutil

    nsenter, unshare = shutil.which("nsenter"), shutil.which("unshare")
    if inner is None or not nsenter or not unshare:
        return (
            f"pid {pid} runs in another PID namespace (a container): --native needs nsenter "
            "and unshare (util-linux) to unwind it from inside"
        )
    argv = [*argv[:-1], str(inner)]
    return [nsenter, "--target", str(pid), "--pid", "--", unshare, "--mount",
            "--propagation", "private", "--mount-proc", *argv]  # fmt: skip


def _to_our_ids(
    threads: list[ThreadStack], ns: dict[int, int], before: dict[int, str]
) -> list[ThreadStack]:
    """Thread ids of the target's namespace -> ours (None where the thread is gone); with
    `before` (the host-side dump), on-CPU from the kernel's state of each thread."""
    out = []
    for t in threads:
        tid = ns.get(t.os_thread_id) if t.os_thread_id is not None else None
        active = t.active
        if before and tid in before:
            active = before[tid] == "R"
        out.append(_replace(t, os_thread_id=tid, active=active))
    return out


def dump_many(pids: Iterable[int], **options) -> dict[int, Dump]:
    """Dump every pid and wait for them all: `start_many`'s options, `start_many(...).wait()`."""
    return start_many(pids, **options).wait()


class Pending:
    """Dumps under way in threads of their own (`start_many`); `wait` returns them (after
    `cancel`, those that were taken)."""

    def __init__(
        self,
        pids: list[int],
        out: dict[int, Dump],
        threads: list[threading.Thread],
        stop: threading.Event,
    ) -> None:
        self._pids, self._out, self._threads, self._stop = pids, out, threads, stop

    def wait(self) -> dict[int, Dump]:
        try:
            for t in self._threads:
                t.join()
        except BaseException:
            # Ctrl-C reaches this thread only: py-spy processes (in sessions of their own) are
            # killed here, none keeps a rank paused after the doctor is gone.
            self.cancel()
            raise
        with _running_lock:
            _pending.discard(self)
        return {pid: self._out[pid] for pid in self._pids if pid in self._out}

    def cancel(self, grace: float = 5.0) -> None:
        """No further py-spy starts; those running are killed, and their threads waited for
        (at most `grace` seconds). Killing once is not enough: a thread may have spawned its
        py-spy and not yet listed it, or checked the stop just before it was set; on a busy
        host that window is long enough to leave a py-spy (and its rank paused) behind."""
        self._stop.set()
        # A thread not alive once the stop is set (not started, or starting) never dumps.
        others = [t for t in self._threads if t is not threading.current_thread()]
        others = [t for t in others if t.is_alive()]
        deadline = time.monotonic() + grace
        while True:
            _kill_running()
            for t in others:
                t.join(0.02)
            others = [t for t in others if t.is_alive()]
            if not others or time.monotonic() > deadline:
                break
        with _running_lock:
            _pending.discard(self)


_pending: set[Pending] = set()  # started and neither waited for nor cancelled


@atexit.register
def _cancel_all() -> None:
    with _running_lock:
        left = list(_pending)
    for pending in left:
        pending.cancel()


def start_many(
    pids: Iterable[int],
    *,
    pyspy: str,
    native: bool = False,
    show_locals: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
    previous: dict[int, Dump] | None = None,
    workers: int | None = None,
    on_done: Callable[[Dump], None] | None = None,
    counters: bool = True,
) -> Pending:
    """Dump every pid, `workers` py-spy processes at a time (default: `default_workers`),
    without waiting: the py-spy processes start now, and the caller's thread is free meanwhile
    (the doctor checks permissions and imports what judges the dumps while they run); `wait`
    on the result returns the dumps. With `previous` (the last sample), a process none of whose
    Python threads ran since is not dumped again. `counters=False`: no sample follows, so the
    scheduler counters that would tell it what ran meanwhile are not read after the dump."""
    pids = list(dict.fromkeys(pids))
    out: dict[int, Dump] = {}
    todo = iter(pids)
    lock = threading.Lock()
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            with lock:
                pid = next(todo, None)
            if pid is None:
                return
            d = _sample(
                pid,
                previous.get(pid) if previous else None,
                pyspy=pyspy,
                native=native,
                show_locals=show_locals,
                timeout=timeout,
                counters=counters,
            )
            with lock:
                out[pid] = d
                if on_done is not None:
                    on_done(d)

    n = max(1, min(len(pids), workers or default_workers())) if pids else 0
    # Daemon threads, cancelled at exit (_cancel_all): a Ctrl-C that lands before the caller
    # waits (while these start, or between start_many and wait) would otherwise leave the
    # interpreter waiting out each py-spy's timeout, the ranks paused meanwhile.
    threads = [threading.Thread(target=work, name=f"py-spy-{i}", daemon=True) for i in range(n)]
    pending = Pending(pids, out, threads, stop)
    with _running_lock:
        _pending.add(pending)
    for t in threads:
        t.start()
    return pending


def _sample(
    pid: int,
    prev: Dump | None,
    *,
    pyspy: str,
    native: bool,
    show_locals: bool,
    timeout: float,
    counters: bool = True,
) -> Dump:
    """This sample of one process: its previous dump again when none of its Python threads
    ran since, else a fresh dump; with what each thread did in between (and, with
    `counters`, the counters the next sample compares against)."""
    ran = None
    if prev is not None and prev.ok and prev.counters:
        now = read_counters(pid, prev.counters)
        if not _pid_exists(pid):  # a zombie keeps its last counters: check before reusing
            return _new_dump(
                pid, error="the process exited", error_kind="gone", taken_at=time.time()
            )
        ran = {
            tid: max(0, now[tid][1] - runs)
            for tid, (_, runs) in prev.counters.items()
            if tid in now
        }
        if did_not_run(prev.counters, now, prev.pending):
            return _replace(
                prev,
                counters=now,
                pending=frozenset(),
                ran=ran,
                reused=True,
                stopped=is_stopped(pid),
                taken_at=time.time(),
                elapsed_s=0.0,
            )
    d = dump(pid, pyspy=pyspy, native=native, show_locals=show_locals, timeout=timeout)
    if d.ok:
        if counters:
            d.counters, d.pending = counters_after_dump(pid, d.threads)
        d.ran = ran
    return d


def did_not_run(before: Counters, now: Counters, pending: frozenset[int]) -> bool:
    """No thread was scheduled in between the two readings.

    For a thread whose resume was counted ahead only the count can be compared (the resume
    itself takes CPU time), and one less means the resume had already been counted.
    """
    if now.keys() != before.keys():
        return False
    for tid, (cpu, runs) in before.items():
        now_cpu, now_runs = now[tid]
        if tid in pending:
            if now_runs not in (runs, runs - 1):
                return False
        elif (now_cpu, now_runs) != (cpu, runs):
            return False
    return True


def default_workers() -> int:
    """How many py-spy processes run at once: at least MIN_WORKERS, and one more than the
    CPUs this process may use (its affinity mask, capped by a cgroup CPU quota).

    Part of each dump is spent waiting for the target's threads to be scheduled and stop,
    time in which another py-spy can use the CPU. And a doctor is run on a busy host: there
    its dumps' share of the CPUs grows with how many of them run (16 at once took 150-230 ms
    for 16 ranks at a load average of 15 on two cores, 3 at once 310-400 ms); each py-spy
    holds about 18 MB.
    """
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(MIN_WORKERS, max(1, n) + 1)


# --------------------------------------------------------------------------- scheduler counters


def read_counters(pid: int, tids: Iterable[int]) -> Counters:
    """(CPU ns, times scheduled in) of each thread that still exists."""
    out: Counters = {}
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                fields = f.read().split()
            out[tid] = (int(fields[0]), int(fields[2]))
        except (OSError, ValueError, IndexError):
            continue
    return out


def counters_after_dump(pid: int, threads: list[ThreadStack]) -> tuple[Counters, frozenset[int]]:
    """The counters as they stand once the dump's own doing is over, and the threads whose
    resume was counted ahead.

    Let go by py-spy, a thread it found asleep is scheduled in once more to resume its wait;
    until that has happened (the thread is not asleep yet) the run is counted ahead, so that
    it never looks like the thread's own activity. Nothing is waited for.
    """
    tids = [t.os_thread_id for t in threads if t.os_thread_id]
    pending = {
        t.os_thread_id
        for t in threads
        if t.os_thread_id and not t.active and _thread_state(pid, t.os_thread_id) not in "SDI"
    }
    counters = {
        tid: (cpu, runs + (tid in pending)) for tid, (cpu, runs) in read_counters(pid, tids).items()
    }
    return counters, frozenset(pending)


def _thread_state(pid: int, tid: int) -> str:
    """The kernel's one-letter state of a thread (S sleeping, R running, t traced); "X" if gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
            text = f.read()
        end = text.rindex(b")")
        return text[end + 2 : end + 3].decode() or "X"
    except (OSError, ValueError):
        return "X"


def classify_error(stderr: str, pid: int) -> str:
    text = stderr.lower()
    if not _pid_exists(pid):
        return "gone"
    if "permission denied" in text or "operation not permitted" in text or "os error 1)" in text:
        return "permission"
    if "unsupported version" in text or "unknown version" in text or "unsupported python" in text:
        return "version"
    if "failed to find python version" in text or "failed to find a python interpreter" in text:
        return "not_python"
    if "no such process" in text:
        return "gone"
    return "failed"


def _first_error_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    if not lines:
        return ""
    first = lines[0].removeprefix("Error: ")
    # "Caused by:" lines hold the OS reason (Permission denied (os error 13)).
    causes = [
        ln.split(":", 1)[-1].strip()
        for ln in lines[1:]
        if ln[:1].isdigit() and ":" in ln and "os error" in ln
    ]
    if causes and causes[0] not in first:
        first = f"{first} ({causes[0]})"
    return first


def _pid_exists(pid: int) -> bool:
    """Alive and not a zombie (an exited process its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return False
    end = text.rfind(b")")
    return text[end + 2 : end + 3] not in (b"Z", b"X")
