"""Requests a server answered with errors in the last minute: how a trainer that retries a
refused request forever is told from one that works.

A refused trainer looks busy to every other measure: its ranks move, its servers answer
/health. Only the server sees its answers. The replica runner beside each server reads them
on every lease renewal and copies them into the server's registry metadata (`errors`), which
`areal ps`, the watchdog and `doctor hang` read without asking the server anything.

Where the runner reads them:

    hf       the server counts its own answers and keeps the last error's text
             (/server_info `request_errors`)
    sglang   the engine's HTTP access log, which the runner owns (uvicorn's lines
    vllm     `"POST /generate HTTP/1.1" 400 Bad Request`, printed by both by default): the
             status and the route of each answer, read as they appear; the error's own text
             is not in that log, so the last error is the access line itself. An engine
             started with its access log turned off (vLLM's --disable-uvicorn-access-log,
             SGLang's --log-level-http warning) shows no errors.

The counts, as stored: {"window_s", "errors", "answered" (answers below 400), "total" (errors
since the server started, or since the runner began to read its log), "streak" (errors since
the last answer below 400) and "streak_s" (seconds since the first of them), "last": {"at",
"route", "status", "message"} | None, "source": "server" | "access log"}.

A server refuses a trainer when its last REFUSED_STREAK answers or more were errors, for
REFUSED_AFTER_S seconds or more: a retry loop, not one bad request among good ones.
"""

from __future__ import annotations

import collections
import os
import re
import time
from typing import Any

WINDOW_S = 60.0
REFUSED_STREAK = 5
REFUSED_AFTER_S = 10.0
TEXT_MAX = 300
# What nobody's work asks: probes, and the reads of the runner, `areal ps` and the doctor.
UNCOUNTED = frozenset(
    {"/health", "/health_generate", "/ready", "/ping", "/metrics", "/server_info",
     "/get_server_info", "/model_info", "/get_model_info", "/v1/models", "/v1/loads",
     "/is_paused", "/version"}
)  # fmt: skip
# uvicorn's access line: `... "POST /generate HTTP/1.1" 400 Bad Request`.
_ACCESS = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[0-9.]+" (?P<status>\d{3})\b')
# The most of a log read at one renewal: a server that writes faster is read from its end.
_READ_MAX = 4 << 20


def from_server_info(info: Any) -> dict | None:
    """The hf server's own counts, from its /server_info; None where there are none."""
    got = info.get("request_errors") if isinstance(info, dict) else None
    if not isinstance(got, dict) or not isinstance(got.get("errors"), int):
        return None
    return {**got, "source": "server"}


class Counts:
    """A server's answers over the last `window_s` seconds, as stored (less `source`): the
    hf server keeps one of its own answers, AccessLog one of an engine's access lines."""

    def __init__(self, window_s: float = WINDOW_S):
        self.window_s = window_s
        self.total = 0
        self.ok: collections.deque[float] = collections.deque()
        self.errors: collections.deque[float] = collections.deque()
        self.last: dict[str, Any] | None = None
        self.streak = 0  # errors since the last answer below 400
        self.streak_from = 0.0

    def record(self, route: str, status: int, message: str, now: float | None = None) -> None:
        """One answer: `route` ("POST /generate") got `status`; `message`, an error's text."""
        now = time.monotonic() if now is None else now
        if status < 400:
            self.ok.append(now)
            self.streak = 0
        else:
            self.total += 1
            self.errors.append(now)
            if not self.streak:
                self.streak_from = now
            self.streak += 1
            self.last = {"at": time.time(), "route": route, "status": status, "message": message}
        self._prune(now)

    def _prune(self, now: float) -> None:
        for q in (self.ok, self.errors):
            while q and q[0] < now - self.window_s:
                q.popleft()

    def to_json(self, now: float | None = None) -> dict[str, Any]:
        now = time.monotonic() if now is None else now
        self._prune(now)
        return {"window_s": self.window_s, "errors": len(self.errors), "answered": len(self.ok),
                "total": self.total, "streak": self.streak,
                "streak_s": round(now - self.streak_from, 1) if self.streak else 0.0,
                "last": self.last}  # fmt: skip


class AccessLog:
    """The answers an engine's access log shows, read from where it ended at the last read."""

    def __init__(self, path: str | os.PathLike, window_s: float = WINDOW_S):
        self.path = path
        self.offset = 0
        self.partial = b""
        self.counts = Counts(window_s)

    def read(self) -> dict:
        now = time.monotonic()
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self.offset:  # truncated or replaced: start over
                    self.offset, self.partial = 0, b""
                if size - self.offset > _READ_MAX:
                    self.offset, self.partial = size - _READ_MAX, b""
                f.seek(self.offset)
                chunk = f.read(size - self.offset)
        except OSError:
            chunk = b""
        self.offset += len(chunk)
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()
        for raw in lines:
            self._line(raw.decode(errors="replace"), now)
        return {**self.counts.to_json(now), "source": "access log"}

    def _line(self, line: str, now: float) -> None:
        m = _ACCESS.search(line)
        if m is None:
            return
        path = m["path"].split("?", 1)[0]
        if path in UNCOUNTED:
            return
        # The error's own text is not in the log: the access line is the message.
        self.counts.record(f"{m['method']} {path}", int(m["status"]), line.strip()[-TEXT_MAX:],
                           now)  # fmt: skip


def refusing(errors: dict | None) -> bool:
    """The server's last answers were all errors, enough of them for long enough."""
    if not errors:
        return False
    streak, streak_s = errors.get("streak") or 0, errors.get("streak_s") or 0.0
    return streak >= REFUSED_STREAK and streak_s >= REFUSED_AFTER_S


def describe(addr: str, errors: dict) -> str:
    """One line: how many of the last minute's requests failed at `addr`, and the last one."""
    n, ok = errors.get("errors", 0), errors.get("answered", 0)
    window = f"{errors.get('window_s', WINDOW_S):g}s"
    head = f"server {addr} answered {n} of {n + ok} requests of the last {window} with errors"
    if errors.get("streak"):
        head += (
            f", the last {errors['streak']} in a row (for {errors.get('streak_s', 0):g}s):"
            " a client that retries them never gets further"
        )
    last = errors.get("last") or {}
    if last:
        head += f"; last: {last.get('route')} {last.get('status')}: {last.get('message')}"
    return head


def marker(errors: dict | None) -> str:
    """The short mark `areal ps` puts beside a server: "errors 12/min", or ""."""
    if not errors or not errors.get("errors"):
        return ""
    return f"errors {errors['errors']}/{errors.get('window_s', WINDOW_S) / 60:g}min".replace(
        "/1min", "/min"
    )


def refusals(
    registry: str, trials: list[tuple[str, str]], addrs: set[str] | None = None
) -> list[str]:
    """One line per server registered under `trials` (only those at `addrs`, when given)
    that refuses its clients (`refusing`): what the watchdog and `doctor hang` say."""
    from areal_cli.registry import open_registry

    reg = open_registry(registry)
    out = []
    for experiment, trial in dict.fromkeys(trials):
        for e in reg.list(experiment, trial).servers:
            if (not addrs or e.addr in addrs) and refusing(e.errors):
                out.append(describe(e.addr, e.errors))
    return out


def of_trial(registry: str, experiment: str, trial: str):
    """The `refused` callable of a cluster job's watchdog: the servers of its trial."""
    return lambda: refusals(registry, [(experiment, trial)])
