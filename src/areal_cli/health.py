"""One GET of a server's health endpoint. Standard library only: `areal ps` probes with it."""

from __future__ import annotations


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


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
