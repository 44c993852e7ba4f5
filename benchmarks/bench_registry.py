"""Listing 1000 registered servers (target ≤ 50 ms) on the file registry and on etcd, each beside
the bare read it stands on, measured in the same run: AReaL's own os.walk of the same ENTRY
files, and one raw range request to etcd's JSON gateway. Also how long after its TTL an
unrenewed etcd lease takes its entry away."""

import base64
import http.client
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import report

from areal_cli import settings
from areal_cli.registry import FileRegistry, Registry, ServerEntry, open_registry

REPO = Path(__file__).resolve().parents[1]
N = 1000


def bare_walk(root: Path) -> list[str]:
    out = []
    for d, _, files in os.walk(root):
        if files == ["ENTRY"]:
            with open(os.path.join(d, "ENTRY")) as f:
                out.append(f.read())
    return out


def bare_range(conn: http.client.HTTPConnection, prefix: str) -> list[bytes]:
    """One range request over a kept-alive connection, decoded: the floor under any client."""
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    body = {"key": base64.b64encode(prefix.encode()).decode(),
            "range_end": base64.b64encode(end.encode()).decode()}  # fmt: skip
    conn.request("POST", "/v3/kv/range", json.dumps(body), {"Content-Type": "application/json"})
    kvs = json.loads(conn.getresponse().read()).get("kvs", [])
    return [base64.b64decode(kv.get("value", "")) for kv in kvs]


def fill(reg: Registry) -> None:
    for i in range(N):
        reg.register(ServerEntry(id=f"h_{i}", addr=f"127.0.0.1:{20000 + i}", experiment="e",
                                 trial="t", host=settings.hostname(), pid=os.getpid()))  # fmt: skip


def median_ms(fn, repeat: int = 9) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def bench_file(tmp: str) -> float:
    reg = FileRegistry(tmp)
    fill(reg)
    assert len(reg.list("e", "t").servers) == N
    ours = median_ms(lambda: reg.list("e", "t"))
    base = median_ms(lambda: bare_walk(Path(tmp) / settings.user() / "e" / "t" / "gen_servers"))
    print(f"  file: list({N}) {ours:.1f} ms with liveness checks; bare os.walk {base:.1f} ms")
    report("registry_list_1000_vs_bare_walk", ours / base, "informational", True)
    return ours


def bench_etcd(tmp: str, file_ms: float) -> bool:
    sys.path.insert(0, str(REPO / "tests"))
    from services import EtcdServer, etcd_missing  # the tests' way of starting etcd

    if etcd_missing():
        print(f"  etcd: skipped ({etcd_missing()})")
        return True
    server = EtcdServer(Path(tmp) / "etcd").start()
    try:
        reg = open_registry(server.url)
        fill(reg)
        requests = []
        post = reg._client._post
        reg._client._post = lambda *a: requests.append(a[0]) or post(*a)
        assert len(reg.list("e", "t").servers) == N
        reg._client._post = post
        ours = median_ms(lambda: reg.list("e", "t"))
        conn = http.client.HTTPConnection("127.0.0.1", server.client_port, timeout=10)
        prefix = f"{settings.user()}/e/t/"
        assert len(bare_range(conn, prefix)) == 2 * N  # addresses and metadata
        base = median_ms(lambda: bare_range(conn, prefix))
        conn.close()
        print(f"  etcd: list({N}) {ours:.1f} ms in {len(requests)} request(s) {requests}; "
              f"bare range {base:.1f} ms; file {file_ms:.1f} ms")  # fmt: skip
        report("registry_etcd_list_1000_vs_bare_range", ours / base, "informational", True)
        report("registry_etcd_list_1000_vs_file", ours / file_ms, "informational", True)

        # An unrenewed lease: etcd drops the entry by itself, readers judge nothing.
        ttl = 2
        reg.register(ServerEntry(id="gone", addr="127.0.0.1:1", experiment="x", trial="y",
                                 host=settings.hostname(), pid=os.getpid()), ttl=ttl)  # fmt: skip
        t0 = time.monotonic()
        while reg.list("x", "y").servers:
            time.sleep(0.02)
        over = time.monotonic() - t0 - ttl
        print(f"  etcd: an unrenewed {ttl} s lease dropped its entry {over:+.2f} s after its TTL")
        ok_expiry = report("registry_etcd_lease_expiry_over_ttl_s", over, "<= 1", over <= 1)
        ok_list = report("registry_etcd_list_1000_ms", ours, "<= 50", ours <= 50)
        return ok_expiry and ok_list
    finally:
        server.stop()


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        file_ms = bench_file(os.path.join(tmp, "file"))
        ok_file = report("registry_list_1000_ms", file_ms, "<= 50", file_ms <= 50)
        ok_etcd = bench_etcd(tmp, file_ms)
    return 0 if ok_file and ok_etcd else 1


if __name__ == "__main__":
    sys.exit(main())
