"""The doctor's channel into a live rank: a thread of the rank's own answers requests on a
private Unix socket, so a main thread blocked in a collective still answers.

    server (in the rank)   start() after the process group exists; a daemon thread accepts
    client (the doctor)    ask(pid, "fr") -> the answer, or ChannelError

Where: `<AREAL_HOME>/run/doctor/<pid>.sock`, the folder 0700 and the user's own (a path too
long for a Unix socket, 107 bytes, falls back to `$XDG_RUNTIME_DIR/areal/doctor` when that
folder is the user's and private, else `/tmp/areal-<uid>/doctor`; see places()). Each folder
the rank makes is made 0700, opened without following links and checked to be the user's
own; another user's (a folder or link planted at /tmp/areal-<uid> first) is refused and the
rank runs on without a channel. A socket in a private folder is closed to other users by the
filesystem already; the server still checks each peer's uid with SO_PEERCRED and refuses any
other (a folder made world-writable by mistake must not open the rank to them), root
excepted, who can read the process anyway.

Both ways: the client (the doctor, root's too) takes a socket only when the job's user (the
uid the rank runs as) owns it, and after connecting only when SO_PEERCRED names that user
(and the rank's pid): a socket another user planted is never asked, its answer never read.

One request per connection: a JSON line `{"op": NAME, ...}`; one JSON answer `{"ok": true,
"result": ...}` or `{"ok": false, "error": "..."}`, then the server closes. Each connection
gets a thread of its own, so a handler that blocks (a dump waiting on a lock) stalls no other
request. Requests are looked up in HANDLERS; `register(name, fn)` adds one.

    ping       pid, rank, world size, the requests this rank answers
    progress   the last step reported (ctx.progress), when, how many reports so far and the
               seconds between the last steps
    fr         torch's flight recorder: its dump (JSON) and the job's process groups

Library code: stdlib only at import; torch is imported by the `fr` handler, in a rank that
has it loaded already.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_REQUEST = 64 * 1024
_SUN_PATH = 107  # sockaddr_un's sun_path, less the final NUL
Handler = Callable[[dict], Any]
HANDLERS: dict[str, Handler] = {}


class ChannelError(Exception):
    """The rank has no channel, did not answer in time, or refused the request."""

    def __init__(self, message: str, kind: str = "failed"):
        super().__init__(message)
        self.kind = kind  # absent | timeout | refused | failed


def register(name: str, fn: Handler) -> None:
    """Answer requests `{"op": name, ...}` with fn(request) (JSON-serialisable)."""
    HANDLERS[name] = fn


# --------------------------------------------------------------------------- where


def channel_dir(
    home: str | Path | None = None, uid: int | None = None, env: Mapping[str, str] | None = None
) -> Path:
    """The folder of the sockets for ranks of AREAL_HOME `home` (default: this process's) that
    user `uid` runs (default: this process's user) with environment `env` (default: ours)."""
    return places(home, uid, env)[0]


def places(
    home: str | Path | None = None, uid: int | None = None, env: Mapping[str, str] | None = None
) -> list[Path]:
    """Where a rank may serve its channel, in the order it tries them: `<home>/run/doctor`,
    then (a path too long for a socket) the user's runtime folder `$XDG_RUNTIME_DIR/areal/
    doctor` when it is the user's own and private, then `$TMPDIR/areal-<uid>/doctor` (`/tmp`
    without TMPDIR). The doctor computes the same list from the rank's environment and uid."""
    from areal_cli import settings

    uid = os.geteuid() if uid is None else uid
    env = os.environ if env is None else env
    out = [(Path(home) if home else settings.home()) / "run" / "doctor"]
    xdg = env.get("XDG_RUNTIME_DIR") or ""
    if xdg.startswith("/") and _private_of(Path(xdg), uid) is None:
        out.append(Path(xdg) / "areal" / "doctor")
    tmp = env.get("TMPDIR") or ""
    out.append(Path(tmp if tmp.startswith("/") else "/tmp") / f"areal-{uid}" / "doctor")
    fits = [d for d in out if len(str(d / "4194304.sock").encode()) <= _SUN_PATH]
    return fits or out[-1:]


def socket_path(pid: int, home: str | Path | None = None) -> Path:
    return channel_dir(home) / f"{pid}.sock"


def _private_of(path: Path | int, uid: int, name: str | None = None) -> str | None:
    """Why `path` (or the open folder `path`, an fd) is not a private folder of `uid`: not a
    folder, a link, another user's, open to group or others. None when it is."""
    try:
        st = os.fstat(path) if isinstance(path, int) else os.lstat(path)
    except OSError as e:
        return f"{name or path}: {e.strerror}"
    name = name or str(path)
    if stat.S_ISLNK(st.st_mode):
        return f"{name} is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return f"{name} is not a folder"
    if st.st_uid != uid:
        return f"{name} belongs to uid {st.st_uid}, not to uid {uid}"
    if stat.S_IMODE(st.st_mode) & 0o077:
        return f"{name} is open to other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _open_private(d: Path) -> int:
    """Make the last two components of `d` (`run/doctor`, `areal-<uid>/doctor`) private folders
    of this user and return an fd of `d`, or raise ChannelError "refused".

    As tmux does for /tmp/tmux-<uid>: each is made 0700 if absent, then opened without
    following links (O_NOFOLLOW: another user's link to a folder of ours, or to /tmp itself, is
    refused, never chmod'ed through) and checked on that fd: a folder, our own. One of ours
    left open to others (an earlier run under umask 000) is closed by fchmod on the fd before
    anything under it is trusted. Another user's folder is refused: the rank runs on without a
    channel rather than serve it where that user can reach in."""
    uid = os.geteuid()
    anchor = d.parent.parent
    anchor.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(anchor, os.O_RDONLY | os.O_DIRECTORY)
    shown = anchor
    try:
        for part in (d.parent.name, d.name):
            shown = shown / part
            try:
                os.mkdir(part, 0o700, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                sub = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                try:
                    is_link = stat.S_ISLNK(os.lstat(part, dir_fd=fd).st_mode)
                except OSError:
                    is_link = False
                why = "is a symbolic link" if is_link else f"cannot be opened: {e.strerror}"
                raise ChannelError(f"{shown} {why}", "refused") from None
            os.close(fd)
            fd = sub
            st = os.fstat(fd)
            if st.st_uid != uid:
                raise ChannelError(
                    f"{shown} belongs to uid {st.st_uid}, not to this user (uid {uid})",
                    "refused",
                )
            if stat.S_IMODE(st.st_mode) != 0o700:
                os.fchmod(fd, 0o700)  # ours, and the fd is the folder itself, not a link
            bad = _private_of(fd, uid, str(shown))
            if bad:
                raise ChannelError(bad, "refused")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _private_dir(d: Path) -> Path:
    """`d` made and checked as _open_private does."""
    os.close(_open_private(d))
    return d


# --------------------------------------------------------------------------- progress


# Step times a rank keeps: what `--watchdog auto` takes the median of (diagnose.watchdog).
STEP_TIMES = 20


@dataclass
class Progress:
    step: int | None = None
    time: float | None = None  # time.time() of the last report
    count: int = 0  # reports so far: what the watchdog compares
    source: str | None = None  # "step" | "rollout" | "sync"
    # Seconds between successive step reports (ctx.progress), the last STEP_TIMES, oldest
    # first; rollout and sync reports happen within a step and are no step of their own.
    intervals: list[float] = field(default_factory=list)
    last_step_at: float | None = None  # time.monotonic() of the last step report


PROGRESS = Progress()


def report_progress(step: int | None = None, source: str = "step") -> None:
    """Record that this rank moved on (cheap: a few assignments, no I/O)."""
    if step is not None:
        PROGRESS.step = step
    PROGRESS.time = time.time()
    PROGRESS.source = source
    PROGRESS.count += 1
    if source == "step":
        now = time.monotonic()
        if PROGRESS.last_step_at is not None:
            PROGRESS.intervals.append(now - PROGRESS.last_step_at)
            del PROGRESS.intervals[:-STEP_TIMES]
        PROGRESS.last_step_at = now


# --------------------------------------------------------------------------- handlers


def _ping(_req: dict) -> dict:
    return {
        "pid": os.getpid(),
        "rank": _env_int("RANK"),
        "world_size": _env_int("WORLD_SIZE"),
        "ops": sorted(HANDLERS),
    }


def _progress(_req: dict) -> dict:
    p = PROGRESS
    return {
        "pid": os.getpid(),
        "rank": _env_int("RANK"),
        "step": p.step,
        "time": p.time,
        "count": p.count,
        "source": p.source,
        "intervals": [round(x, 4) for x in list(p.intervals)],  # a copy: the main thread adds
    }


def _fr(_req: dict) -> dict:
    import torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace_json

    dump = json.loads(_dump_fr_trace_json(includeCollectives=True, onlyActive=False))
    return {
        "pid": os.getpid(),
        "rank": dist.get_rank() if dist.is_initialized() else _env_int("RANK"),
        "buffer_size": int(
            os.environ.get("TORCH_FR_BUFFER_SIZE")
            or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")
            or 0
        ),  # fmt: skip
        "groups": known_groups(),
        "dump": dump,
    }


def known_groups() -> dict[str, dict]:
    """This rank's process groups by the name the flight recorder records (`process_group`
    [0] of an entry): desc and global ranks, read from c10d's own table."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return {}
    from torch.distributed.distributed_c10d import _world

    out = {}
    for pg, name in list(_world.pg_names.items()):
        ranks = sorted(_world.pg_group_ranks.get(pg, {}))
        out[str(name)] = {"desc": getattr(pg, "group_desc", "") or "", "ranks": ranks}
    return out


register("ping", _ping)
register("progress", _progress)
register("fr", _fr)


def _env_int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


# --------------------------------------------------------------------------- server


class Server:
    def __init__(self, path: Path, dir_fd: int | None = None):
        """Serve at `path`; `dir_fd`, an fd of its folder that the server then owns, is where
        it removes what it leaves: by the folder it checked, not by a name that may since
        lead elsewhere."""
        self.path = path
        self.dir_fd = dir_fd
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._unlink()  # a socket left by a dead process that had our pid
        old = os.umask(0o077)
        try:
            self.sock.bind(str(path))
        finally:
            os.umask(old)
        self.sock.listen(16)
        self._closed = False
        self.thread = threading.Thread(target=self._accept, name="areal-doctor", daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(
                target=self._serve, args=(conn,), name="areal-doctor-req", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30.0)
            try:
                line = _read_line(conn)  # first: a refusal sent unread would reset the peer
                uid = peer_uid(conn)
                if uid not in (os.getuid(), 0):
                    _send(conn, {"ok": False, "error": f"refused: uid {uid} is not this job's "
                                 "user", "kind": "refused"})  # fmt: skip
                    return
                req = json.loads(line)
                fn = HANDLERS.get(req.get("op")) if isinstance(req, dict) else None
                if fn is None:
                    _send(conn, {"ok": False, "error": f"unknown request {req!r}",
                                 "ops": sorted(HANDLERS)})  # fmt: skip
                    return
                try:
                    answer = {"ok": True, "result": fn(req)}
                except Exception as e:  # the handler's failure is the answer, not our crash
                    answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                _send(conn, answer)
            except (OSError, ValueError):
                return

    def _unlink(self) -> None:
        try:
            if self.dir_fd is None:
                os.unlink(self.path)
            else:
                os.unlink(self.path.name, dir_fd=self.dir_fd)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.close()
        finally:
            try:
                self._unlink()
            except OSError:
                pass
            if self.dir_fd is not None:
                os.close(self.dir_fd)
                self.dir_fd = None


def peer_uid(conn: socket.socket) -> int:
    return peer_cred(conn)[1]


_SERVER: Server | None = None


def start(home: str | Path | None = None) -> Server | None:
    """Serve this process's channel (once per process), in the first of places(home) that is
    this user's own. None when none is (a read-only home and another user's /tmp/areal-<uid>):
    training goes on, the doctor then sees stacks only."""
    global _SERVER
    if _SERVER is not None:
        return _SERVER
    import atexit
    import logging

    refused = []
    for d in places(home):
        fd = None
        try:
            fd = _open_private(d)
            _SERVER = Server(d / f"{os.getpid()}.sock", dir_fd=fd)
            break
        except (OSError, ChannelError) as e:
            if fd is not None:
                os.close(fd)
            refused.append(str(e))
    else:
        logging.getLogger("areal").warning("doctor channel not started: %s", "; ".join(refused))
        return None
    atexit.register(stop)
    return _SERVER


def stop() -> None:
    global _SERVER
    if _SERVER is not None:
        _SERVER.close()
        _SERVER = None


# --------------------------------------------------------------------------- client


def _read_line(conn: socket.socket) -> bytes:
    buf = b""
    while b"\n" not in buf:
        chunk = conn.recv(4096)
        if not chunk:
            break
        buf += chunk
        if len(buf) > MAX_REQUEST:
            raise ValueError("request too long")
    return buf.split(b"\n", 1)[0]


def _send(conn: socket.socket, obj: dict) -> None:
    conn.sendall(json.dumps(obj, default=str).encode() + b"\n")


def rank_pid(pid: int) -> int:
    """The pid the rank knows itself by: the last of NSpid (a rank in a PID namespace of
    its own, a container, names its socket by that one)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        pass
    return pid


def job_uid(pid: int) -> int | None:
    """The (effective) uid the process `pid` runs as: the only user whose sockets and answers
    the doctor trusts for it. None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[2])
    except (OSError, ValueError, IndexError):
        pass
    return None


_ENV_KEYS = ("AREAL_HOME", "XDG_CACHE_HOME", "HOME", "XDG_RUNTIME_DIR", "TMPDIR")


def rank_env(pid: int) -> dict[str, str]:
    """What of the rank's environment says where its channel is (the job's user and root may
    read it); empty when it cannot be read."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    out = {}
    for kv in raw:
        k, sep, v = kv.partition(b"=")
        if sep and k.decode(errors="replace") in _ENV_KEYS and v:
            out[k.decode()] = v.decode(errors="replace")
    return out


def rank_home(pid: int) -> str | None:
    """AREAL_HOME in the rank's environment (the job's user may read it)."""
    return rank_env(pid).get("AREAL_HOME")


def _homes(pid: int, env: Mapping[str, str], home: str | Path | None) -> list:
    """The AREAL_HOMEs the rank may use, most likely first: its AREAL_HOME (relative to its
    cwd), the one given, the default of its environment, ours."""
    out: list = []
    h = env.get("AREAL_HOME")
    if h:
        if h.startswith("~/") and env.get("HOME"):
            h = env["HOME"] + h[1:]  # the rank's ~, not ours
        elif not h.startswith(("/", "~")):
            try:
                h = os.path.join(os.readlink(f"/proc/{pid}/cwd"), h)
            except OSError:
                pass
        out.append(h)
    out.append(home)
    cache = env.get("XDG_CACHE_HOME") or (env["HOME"] + "/.cache" if env.get("HOME") else None)
    if cache:
        out.append(Path(cache) / "areal")
    out.append(None)
    return out


def locate(pid: int, home: str | Path | None = None) -> tuple[Path | None, int | None, str]:
    """(the socket of the rank with host pid `pid`, the job's uid, why sockets found were
    refused). Only a socket the job's own user owns is taken: one another user planted where
    the rank's would be (a folder of theirs at /tmp/areal-<uid>) is refused and said why."""
    uid = job_uid(pid)
    if uid is None:
        return None, None, ""
    own = rank_pid(pid)
    env = rank_env(pid)
    seen: set[Path] = set()
    refused: list[str] = []
    for h in _homes(pid, env, home):
        for d in places(h, uid, env):
            p = d / f"{own}.sock"
            if p in seen:
                continue
            seen.add(p)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if not stat.S_ISSOCK(st.st_mode):
                refused.append(f"{p} is not a socket")
            elif st.st_uid != uid:
                refused.append(f"{p} belongs to uid {st.st_uid}, not to the job's user (uid {uid})")
            else:
                return p, uid, ""
    return None, uid, "; ".join(refused)


def find(pid: int, home: str | Path | None = None) -> Path | None:
    """The socket of the rank with host pid `pid`, or None when it has none of its user's."""
    return locate(pid, home)[0]


def ask(pid: int, op: str, timeout: float = 5.0, home: str | Path | None = None, **args) -> Any:
    """Ask the rank with (host) pid `pid`; its answer's result, or ChannelError (kind
    "refused" when what answers is not the job's own user)."""
    path, uid, refused = locate(pid, home)
    if path is None:
        if refused:
            raise ChannelError(f"pid {pid}: refused {refused}", "refused")
        raise ChannelError(f"pid {pid} has no doctor channel", "absent")
    return _request(path, op, timeout, args, uid=uid, pid=pid)


def ask_path(path: str | Path, op: str, timeout: float = 5.0, /, **args) -> Any:
    """Ask the socket `path`, served by a process of this user (any other is refused)."""
    return _request(path, op, timeout, args)


def peer_cred(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end (pid 0 when not in our namespace)."""
    fmt = "3i"  # struct ucred
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize(fmt))
    pid, uid, gid = struct.unpack(fmt, raw)
    return pid, uid, gid


def _request(
    path: str | Path, op: str, timeout: float, args: dict, uid: int | None = None,
    pid: int | None = None,
) -> Any:  # fmt: skip
    """One request. Before sending, the peer is checked (SO_PEERCRED, what the kernel says of
    the process that listens): the user `uid` (default: ours), and the process `pid` when it
    is in our PID namespace. A forged answer is never read."""
    uid = os.geteuid() if uid is None else uid
    deadline = time.monotonic() + timeout
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(path))
            peer_pid, peer_uid_, _ = peer_cred(s)
            if peer_uid_ != uid:
                raise ChannelError(
                    f"{path}: refused: served by uid {peer_uid_}, not by the job's user "
                    f"(uid {uid})",
                    "refused",
                )
            if pid is not None and peer_pid not in (0, pid):
                raise ChannelError(
                    f"{path}: refused: served by pid {peer_pid}, not by pid {pid}", "refused"
                )
            s.sendall(json.dumps({"op": op, **args}).encode() + b"\n")
            chunks = []
            while True:
                s.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = s.recv(1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
    except TimeoutError:
        raise ChannelError(f"{path}: no answer within {timeout:g}s", "timeout") from None
    except (ConnectionRefusedError, FileNotFoundError):
        raise ChannelError(f"{path}: nobody listens (the rank exited)", "absent") from None
    except OSError as e:
        raise ChannelError(f"{path}: {e}", "failed") from None
    try:
        answer = json.loads(b"".join(chunks))
    except ValueError:
        raise ChannelError(f"{path}: the answer is not JSON", "failed") from None
    if not answer.get("ok"):
        raise ChannelError(answer.get("error") or "refused", answer.get("kind", "failed"))
    return answer.get("result")
