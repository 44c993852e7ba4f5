"""Is an inference server paused, and resume it: for a teardown, `areal ps` and discovery,
which must not wait on a hung server nor import the worker runtime (stdlib only).

Which routes say what, per backend, is each engine's protocol module
(`backends/protocol_sglang.py`, spoken by sglang and hf; `backends/protocol_vllm.py`) and
its `paused_query`:
    hf      paused: /server_info "batching.paused"
    sglang  no pause flag: /ready 503 with /ping 200 is a pause. A pause that outlasted a
            health check (20 s idle) flags the server unhealthy too: then it cannot be told
            from a sick one (None).
    vllm    GET /is_paused -> {"is_paused"} (served with VLLM_SERVER_DEV_MODE=1)
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterable

from areal_cli import backends
from areal_cli.backends import protocol_for
from areal_cli.backends import protocol_sglang as _sglang
from areal_cli.backends import protocol_vllm as _vllm


def _call(
    addr: str, method: str, path: str, key: str | None, timeout: float
) -> tuple[int, object] | None:
    """(status, decoded body) or None when nothing answered in time."""
    req = urllib.request.Request(
        f"http://{addr}{path}", data=b"{}" if method == "POST" else None, method=method
    )
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (OSError, ValueError):  # refused, reset, timed out, a malformed answer
        return None
    try:
        return status, json.loads(raw) if raw.strip() else None
    except ValueError:
        return status, raw.decode(errors="replace")


def resume(addr: str, backend: str, key: str | None = None, timeout: float = 5.0) -> bool:
    """Ask the server to continue generating; True when it said yes."""
    got = _call(addr, "POST", protocol_for(backend).RESUME_PATH, key, timeout)
    return got is not None and got[0] == 200


def paused(addr: str, backend: str, key: str | None = None, timeout: float = 2.0) -> bool | None:
    """True: paused; False: not paused; None: cannot tell (no answer, no such route, a
    key it refuses, or an SGLang server flagged unhealthy)."""
    return _paused(addr, backend, key, timeout)[0]


def _paused(addr: str, backend: str, key: str | None, timeout: float) -> tuple[bool | None, bool]:
    """(paused as `paused` says, whether the server answered at all)."""
    engine = backends.resolve(backend)
    proto, query = engine.protocol, engine.paused_query()
    if query is not None:
        got = _call(addr, "GET", query[0], key, timeout)
        if got is None:
            return None, False
        flag = query[1](got[1]) if got[0] == 200 else None
        if flag is not None or not proto.PAUSED_BY_READINESS:
            return flag, True
    if not proto.PAUSED_BY_READINESS:
        return None, True
    got = _call(addr, "GET", proto.READY_PATH, None, timeout)
    if got is None:
        return None, False
    if got[0] == 200:
        return False, True
    ping = _call(addr, "GET", proto.PING_PATH, key, timeout)
    return (True if ping is not None and ping[0] == 200 else None), True


def _each(fn, addrs: list[str]) -> dict:
    if not addrs:
        return {}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(32, len(addrs))) as ex:
        return dict(zip(addrs, ex.map(fn, addrs), strict=True))


def paused_all(
    addrs: Iterable[str], backend: str, key: str | None = None, timeout: float = 2.0
) -> dict[str, bool | None]:
    """`paused` of every address at once."""
    return _each(lambda a: paused(a, backend, key, timeout), list(dict.fromkeys(addrs)))


def resume_paused(
    addrs: Iterable[str], backend: str, key: str | None = None, timeout: float = 5.0
) -> list[str]:
    """Resume every server that is paused, or answers but cannot say (resuming a running
    server does no harm); returns those that took the resume. A server that does not answer
    is left alone. All at once, each request bounded by `timeout`."""

    def one(addr: str) -> bool:
        was, answered = _paused(addr, backend, key, timeout)
        return answered and was is not False and resume(addr, backend, key, timeout)

    return [a for a, ok in _each(one, list(dict.fromkeys(addrs))).items() if ok]


def key_refused(addr: str, backend: str, key: str | None, timeout: float = 5.0) -> int | None:
    """401 or 403 when the server refuses `key` (None: no key) on a route its key guards;
    None when it takes it, or cannot tell (no answer in time, no such route)."""
    # /health is open on every engine: ask a route the key guards.
    for path in protocol_for(backend).GUARDED_PATHS:
        got = _call(addr, "GET", path, key, timeout)
        if got is None:
            return None
        if got[0] in (401, 403):
            return got[0]
        if got[0] != 404:
            return None
    return None


def keys_refused(
    addrs: Iterable[str], backend: str, key: str | None, timeout: float = 5.0
) -> dict[str, int]:
    """The servers among `addrs` that refuse `key`, with the status they answered; all asked
    at once."""
    got = _each(lambda a: key_refused(a, backend, key, timeout), list(dict.fromkeys(addrs)))
    return {a: status for a, status in got.items() if status is not None}


def identify(addr: str, key: str | None = None, timeout: float = 5.0) -> str | None:
    """Which engine answers at `addr`, asked over HTTP: the hf server names itself in
    /server_info, SGLang answers it with its launch arguments (vLLM's dev mode with its
    config), vLLM lists its models as owned by "vllm"; None when it cannot tell."""
    got = _call(addr, "GET", _sglang.SERVER_INFO_PATHS[0], key, timeout)
    if got is not None and got[0] == 200 and isinstance(got[1], dict):
        return backends.identify(got[1], None)
    got = _call(addr, "GET", _vllm.MODELS_PATH, key, timeout)
    if got is not None and got[0] == 200:
        owners = {m.get("owned_by") for m in _vllm.parse_models(got[1]) if isinstance(m, dict)}
        return backends.identify(None, owners)
    return None


def backend_of(argv: list[str]) -> str | None:
    """Which backend a server's command line runs (a job record keeps only the argv)."""
    return backends.launched_by(argv)
