"""One GET of a server's health endpoint, and the one generation readiness sends after it.
Standard library only: `areal ps` probes with it."""

from __future__ import annotations

# Long enough for SGLang, whose /health answers after at least a second: it sends one
# generation and sleeps 1 s before it looks for an answer (srt/entrypoints/http_server.py:777-779).
PROBE_TIMEOUT = 3.0


def probe_health(
    host: str, port: int, path: str, api_key: str | None, timeout: float = 2.0
) -> bool:
    import http.client  # 15 ms (email, ssl): paid only when there is a server to probe

    conn = http.client.HTTPConnection(_connect_host(host), port, timeout=timeout)
    try:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        conn.request("GET", path, headers=headers)
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def first_request(
    host: str, port: int, path: str, body: dict, api_key: str | None, timeout: float
) -> str | None:
    """POST one JSON request; None when the answer is 200, else what went wrong."""
    import http.client
    import json

    conn = http.client.HTTPConnection(_connect_host(host), port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        conn.request("POST", path, body=json.dumps(body), headers=headers)
        resp = conn.getresponse()
        text = resp.read(400).decode(errors="replace").strip()
        return None if resp.status == 200 else f"POST {path}: HTTP {resp.status} {text}"
    except (OSError, http.client.HTTPException) as e:
        return f"POST {path}: {type(e).__name__} {e}".rstrip()
    finally:
        conn.close()


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
