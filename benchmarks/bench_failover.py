"""How long a dead server stays in discovery, on the file registry and on etcd, in one run.

Two deaths of a server that `areal serve` started (a stand-in server, TTL 2 s):
  server   the server process is SIGKILLed; its runner deregisters it
  host     server and runner are SIGKILLed together (a host that dies): nothing deregisters;
           a reader on this host sees the pid gone at once; a reader on another host waits
           for the file entry's heartbeat to age past its TTL, or for etcd's lease to run out
Printed as seconds from the SIGKILL to the entry's absence from a listing.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from _common import AREAL, report

from areal_cli import settings
from areal_cli.registry import open_registry

REPO = Path(__file__).resolve().parents[1]
FAKE = str(REPO / "tests" / "fixtures" / "fake_python.py")
TTL = 2.0


def gone_after(url: str, addr: str, kill: list[psutil.Process]) -> tuple[float, float]:
    """Seconds until a reader here, and a reader on another host, stop listing `addr`."""
    reg = open_registry(url)
    t0 = time.monotonic()
    for p in kill:
        p.send_signal(signal.SIGKILL)
    here = elsewhere = None
    while here is None or elsewhere is None:
        now = time.monotonic() - t0
        if now > 60:
            return here or float("inf"), elsewhere or float("inf")
        if here is None and addr not in addrs(reg):
            here = now
        if elsewhere is None:
            real, settings.hostname = settings.hostname, lambda: "another-host"
            try:
                if addr not in addrs(reg):
                    elsewhere = now
            finally:
                settings.hostname = real
        time.sleep(0.01)
    return here, elsewhere


def addrs(reg) -> list[str]:
    return [e.addr for e in reg.list("default", "trial0").servers]


def measure(url: str, tmp: str) -> tuple[float, tuple[float, float]]:
    model = Path(tmp) / "model"
    model.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "AREAL_REGISTRY": url, "AREAL_HOME": str(Path(tmp) / "home"),
           "AREAL_REGISTRY_TTL": str(TTL), "FAKE_REAL_PYTHON": sys.executable}  # fmt: skip
    out = subprocess.run(
        [AREAL, "serve", "--backend", "hf", "--model", str(model), "--python", FAKE,
         "--alloc", "hf:d2", "--detach", "--json"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    try:
        a, b = json.loads(out.stdout)["servers"]
        server_kill = gone_after(url, a["addr"], [psutil.Process(a["pid"])])[0]
        server = psutil.Process(b["pid"])
        host_death = gone_after(url, b["addr"], [server.parent(), server])
    finally:
        subprocess.run([AREAL, "stop", "default/trial0"], env=env, capture_output=True)
    return server_kill, host_death


def main() -> int:
    sys.path.insert(0, str(REPO / "tests"))
    from services import EtcdServer, etcd_missing  # the tests' way of starting etcd

    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        f_kill, f_host = measure(str(Path(tmp) / "reg"), os.path.join(tmp, "f"))
        print(f"  file: server killed {f_kill:.2f} s; host died: {f_host[0]:.2f} s here, "
              f"{f_host[1]:.2f} s from another host (heartbeat TTL {TTL:g} s)")  # fmt: skip
        if etcd_missing():
            print(f"  etcd: skipped ({etcd_missing()})")
            return 0
        server = EtcdServer(Path(tmp) / "etcd").start()
        try:
            e_kill, e_host = measure(server.url, os.path.join(tmp, "e"))
        finally:
            server.stop()
        print(f"  etcd: server killed {e_kill:.2f} s; host died: {e_host[0]:.2f} s here, "
              f"{e_host[1]:.2f} s from another host (lease TTL {TTL:g} s)")  # fmt: skip
        limit = TTL + 1
        ok &= report("failover_file_server_killed_s", f_kill, "<= 1", f_kill <= 1)
        ok &= report("failover_etcd_server_killed_s", e_kill, "<= 1", e_kill <= 1)
        ok &= report("failover_file_host_died_elsewhere_s", f_host[1], f"<= {limit:g}",
                     f_host[1] <= limit)  # fmt: skip
        ok &= report("failover_etcd_host_died_elsewhere_s", e_host[1], f"<= {limit:g}",
                     e_host[1] <= limit)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
