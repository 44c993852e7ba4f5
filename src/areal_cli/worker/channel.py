"""The doctor's channel into a live rank: a thread of the rank's own answers requests on a
private Unix socket, so a main thread blocked in a collective still answers.

    server (in the rank)   start() after the process group exists; a daemon thread accepts
    client (the doctor)    ask(pid, "fr") -> the answer, or ChannelError

Where: `<AREAL_HOME>/run/doctor/<pid>.sock`, the folder 0700 and the user's own (a path too
long for a Unix socket, 107 bytes, falls back to `/tmp/areal-<uid>/doctor`). A socket in a
private folder is closed to other users by the filesystem already; the server still checks
each peer's uid with SO_PEERCRED and refuses any other (a folder made world-writable by
mistake must not open the rank to them), root excepted, who can read the process anyway.

One request per connection: a JSON line `{"op": NAME, ...}`; one JSON answer `{"ok": true,
"result": ...}` or `{"ok": false, "error": "..."}`, then the server closes. Each connection
gets a thread of its own, so a handler that blocks (a dump waiting on a lock) stalls no other
request. Requests are looked up in HANDLERS; `register(name, fn)` adds one.

    ping       pid, rank, world size, the requests this rank answers
    progress   the last step reported (ctx.progress), when, and how many reports so far
    fr         torch's flight recorder: its dump (JSON) and the job's process groups

Library code: stdlib only at import; torch is imported by the `fr` handler, in a rank that
has it loaded already.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
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


def channel_dir(home: str | Path | None = None) -> Path:
    """The folder of the sockets for ranks of AREAL_HOME `home` (default: this process's)."""
    from areal_cli import settings

    base = Path(home) if home else settings.home()
    d = base / "run" / "doctor"
    if len(str(d / "4194304.sock").encode()) > _SUN_PATH:
        d = Path("/tmp") / f"areal-{os.getuid()}" / "doctor"
    return d


def socket_path(pid: int, home: str | Path | None = None) -> Path:
    return channel_dir(home) / f"{pid}.sock"


def _private_dir(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = d.stat()
    if st.st_uid != os.getuid():
        raise ChannelError(f"{d} belongs to uid {st.st_uid}, not to this user", "refused")
    if st.st_mode & 0o077:
        os.chmod(d, 0o700)
    return d


# --------------------------------------------------------------------------- progress


@dataclass
class Progress:
    step: int | None = None
    time: float | None = None  # time.time() of the last report
    count: int = 0  # reports so far: what the watchdog compares
    source: str | None = None  # "step" | "rollout" | "sync"


PROGRESS = Progress()


def report_progress(step: int | None = None, source: str = "step") -> None:
    """Record that this rank moved on (cheap: a few assignments, no I/O)."""
    if step is not None:
        PROGRESS.step = step
    PROGRESS.time = time.time()
    PROGRESS.source = source
    PROGRESS.count += 1


# --------------------------------------------------------------------------- handlers


def _ping(_req: dict) -> dict:
    return {
        "pid": os.getpid(),
        "rank": _env_int("RANK"),
        "world_size": _env_int("WORLD_SIZE"),
        "ops": sorted(HANDLERS),
    }


def _progress(_req: dict) -> dict:
    return {"pid": os.getpid(), "rank": _env_int("RANK"), **PROGRESS.__dict__}


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
    def __init__(self, path: Path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if path.exists() or path.is_symlink():
            path.unlink()  # a socket left by a dead process that had our pid
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

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.close()
        finally:
            try:
                self.path.unlink()
            except OSError:
                pass


def peer_uid(conn: socket.socket) -> int:
    fmt = "3i"  # struct ucred: pid, uid, gid
    _pid, uid, _gid = struct.unpack(
        fmt, conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize(fmt))
    )
    return uid


_SERVER: Server | None = None


def start(home: str | Path | None = None) -> Server | None:
    """Serve this process's channel (once per process). None when it cannot be made (a
    read-only home): training goes on, the doctor then sees stacks only."""
    global _SERVER
    if _SERVER is not None:
        return _SERVER
    import atexit
    import logging

    try:
        d = _private_dir(channel_dir(home))
        _SERVER = Server(d / f"{os.getpid()}.sock")
    except (OSError, ChannelError) as e:
        logging.getLogger("areal").warning("doctor channel not started: %s", e)
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


def rank_home(pid: int) -> str | None:
    """AREAL_HOME in the rank's environment (the job's user may read it)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for kv in env:
        if kv.startswith(b"AREAL_HOME="):
            return kv[len(b"AREAL_HOME=") :].decode(errors="replace") or None
    return None


def find(pid: int, home: str | Path | None = None) -> Path | None:
    """The socket of the rank with host pid `pid`, or None when it has none."""
    own = rank_pid(pid)
    homes = [rank_home(pid), home, None]
    seen = set()
    for h in homes:
        p = socket_path(own, h)
        if p in seen:
            continue
        seen.add(p)
        if p.exists():
            return p
    return None


def ask(pid: int, op: str, timeout: float = 5.0, home: str | Path | None = None, **args) -> Any:
    """Ask the rank with (host) pid `pid`; its answer's result, or ChannelError."""
    path = find(pid, home)
    if path is None:
        raise ChannelError(f"pid {pid} has no doctor channel", "absent")
    return ask_path(path, op, timeout, **args)


def ask_path(path: str | Path, op: str, timeout: float = 5.0, **args) -> Any:
    deadline = time.monotonic() + timeout
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(path))
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
