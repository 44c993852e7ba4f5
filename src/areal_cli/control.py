"""Is an inference server paused, and resume it: for a teardown, `areal ps` and discovery,
which must not wait on a hung server nor import the worker runtime (stdlib only).

What each backend offers:
    hf      POST /continue_generation; paused: /server_info "batching.paused"
    sglang  POST /continue_generation. 0.5.23 has no pause flag: /ready is 503 while paused
            or unhealthy (TokenizerManager.is_ready, tokenizer_manager.py:732-734, its route
            http_server.py:714-718) and /ping 503 only while unhealthy (http_server.py:
            2189-2199), so /ready 503 with /ping 200 is a pause. A pause that outlasted a
            health check (20 s idle) flags the server unhealthy too: then it cannot be told
            from a sick one (None).
    vllm    POST /resume; GET /is_paused -> {"is_paused"} (entrypoints/rl/online/
            api_router.py:78-159; served with VLLM_SERVER_DEV_MODE=1)
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterable

RESUME_PATH = {"vllm": "/resume"}  # else SGLang's /continue_generation


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
    got = _call(addr, "POST", RESUME_PATH.get(backend, "/continue_generation"), key, timeout)
    return got is not None and got[0] == 200


def paused(addr: str, backend: str, key: str | None = None, timeout: float = 2.0) -> bool | None:
    """True: paused; False: not paused; None: cannot tell (no answer, no such route, a
    key it refuses, or an SGLang server flagged unhealthy)."""
    return _paused(addr, backend, key, timeout)[0]


def _paused(addr: str, backend: str, key: str | None, timeout: float) -> tuple[bool | None, bool]:
    """(paused as `paused` says, whether the server answered at all)."""
    if backend == "vllm":
        got = _call(addr, "GET", "/is_paused", key, timeout)
        if got and got[0] == 200 and isinstance(got[1], dict) and "is_paused" in got[1]:
            return bool(got[1]["is_paused"]), True
        return None, got is not None
    if backend == "hf":
        got = _call(addr, "GET", "/server_info", key, timeout)
        if got is None:
            return None, False
        if got[0] == 200 and isinstance(got[1], dict):
            flag = (got[1].get("batching") or {}).get("paused")
            if isinstance(flag, bool):
                return flag, True
    got = _call(addr, "GET", "/ready", None, timeout)
    if got is None:
        return None, False
    if got[0] == 200:
        return False, True
    ping = _call(addr, "GET", "/ping", key, timeout)
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


# A route each engine guards with its API key, cheap to ask: /health is open on all of them
# (SGLang srt/utils/auth.py:96-106 lets /health, /ready, /metrics through; vLLM guards only
# /v1 and a few other prefixes, serve/middleware/authenticate.py:11).
GUARDED_PATHS = {"vllm": ("/v1/models",)}  # else SGLang's and hf's /model_info
_GUARDED_DEFAULT = ("/model_info", "/v1/models")


def key_refused(addr: str, backend: str, key: str | None, timeout: float = 5.0) -> int | None:
    """401 or 403 when the server refuses `key` (None: no key) on a route its key guards;
    None when it takes it, or cannot tell (no answer in time, no such route)."""
    for path in GUARDED_PATHS.get(backend, _GUARDED_DEFAULT):
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


def backend_of(argv: list[str]) -> str | None:
    """Which backend a server's command line runs (a job record keeps only the argv)."""
    if "sglang.launch_server" in argv:
        return "sglang"
    if "areal_cli.server" in argv:
        return "hf"
    if "serve" in argv and any(a.endswith("vllm") for a in argv):
        return "vllm"
    return None
