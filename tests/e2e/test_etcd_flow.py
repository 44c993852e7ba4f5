"""The whole flow on an etcd registry (a real etcd): serve, then a training-only allocation
finds the servers; faults: servers and hosts that die, etcd that dies and comes back, etcd
that is down when training looks."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest

from areal_cli.registry import open_registry
from tests.helpers import REPO, areal, fake_serve_args

GRPO = str(REPO / "templates" / "grpo" / "train.py")
TINY_CFG = str(REPO / "templates" / "grpo" / "tiny_cpu.yaml")
SCRIPT = str(REPO / "tests" / "fixtures" / "scripts" / "record_env.py")


def _wait(pred, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def _listed(url: str) -> list[str]:
    return [e.addr for e in open_registry(url).list("default", "trial0").servers]


@pytest.fixture
def on_etcd(etcd, monkeypatch):
    monkeypatch.setenv("AREAL_REGISTRY", etcd.url)
    return etcd


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from areal_cli.modelgen import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


@pytest.mark.slow
def test_serve_then_train_finds_the_servers_through_etcd(on_etcd, tiny):
    out = json.loads(areal("serve", "--backend", "hf", "--model", str(tiny), "--detach",
                           "--json", check=0, timeout=120).stdout)  # fmt: skip
    try:
        (server,) = out["servers"]
        # AReaL's own reader: a plain prefix read of .../gen_servers sees the address only.
        keys = on_etcd.get_prefix(f"{os.environ.get('USER', 'root')}/default/trial0/gen_servers")
        assert list(keys.values()) == [server["addr"]]
        res = areal("train", "--alloc", "fsdp:d2", GRPO, "--config", TINY_CFG, "steps=3",
                    check=0, timeout=300)  # fmt: skip
        assert f"servers 1 hf: {server['addr']}" in res.stderr
        assert "training finished with exit code 0" in res.stderr
        # The ranks were in the rank table while they lived, under leases: none is left.
        assert open_registry(on_etcd.url).ranks("default", "trial0", include_dead=True) == []
        plan = json.loads(areal("train", "--alloc", "fsdp:d1", "--areal-overrides", "--dry-run",
                                "--json", SCRIPT, check=0).stdout)  # fmt: skip
        argv = plan["processes"][0]["argv"]
        assert "++cluster.name_resolve.type=etcd3" in argv
        assert any(a.startswith("++cluster.name_resolve.etcd3_addr=127.0.0.1:") for a in argv)
    finally:
        areal("stop", "default/trial0", check=0)
    # Stop revoked the leases: nothing of the job is left in etcd.
    assert on_etcd.get_prefix(os.environ.get("USER", "root") + "/default") == {}


def test_a_killed_server_and_a_dead_host_drop_out(on_etcd, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    env = {"AREAL_REGISTRY_TTL": "2"}
    out = json.loads(areal(*fake_serve_args(model, "--alloc", "hf:d2", "--detach", "--json"),
                           env=env, check=0).stdout)  # fmt: skip
    try:
        a, b = out["servers"]
        # A server killed: its runner deregisters it at once.
        psutil.Process(a["pid"]).kill()
        assert _wait(lambda: a["addr"] not in _listed(on_etcd.url), 1.0)
        # A host that dies (server and runner gone without a word): the lease runs out.
        server = psutil.Process(b["pid"])
        runner = server.parent()
        for p in (runner, server):
            p.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        assert _wait(lambda: b["addr"] not in _listed(on_etcd.url), 2 + 1.5)
        assert time.monotonic() - t0 <= 3.0
    finally:
        areal("stop", "default/trial0", check=0)


def test_servers_outlive_an_etcd_restart_and_register_again(etcd_factory, tmp_path, monkeypatch):
    store = etcd_factory()
    monkeypatch.setenv("AREAL_REGISTRY", store.url)
    model = tmp_path / "model"
    model.mkdir()
    out = json.loads(areal(*fake_serve_args(model, "--detach", "--json"),
                           env={"AREAL_REGISTRY_TTL": "2"}, check=0).stdout)  # fmt: skip
    try:
        (server,) = out["servers"]
        store.kill()
        time.sleep(3)  # renewals fail; the lease runs out while etcd is down
        port = int(server["addr"].rsplit(":", 1)[1])
        import urllib.request

        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200
        # Discovery with etcd down: exit 3, naming the registry.
        res = areal("train", "--alloc", "fsdp:d1", "--wait-servers", "1", SCRIPT, check=3)
        assert store.url in res.stderr and "Traceback" not in res.stderr
        store.start()
        assert _wait(lambda: _listed(store.url) == [server["addr"]], 15)
        log = areal("logs", "default/trial0", "--role", "server", "-n", "100", check=0).stdout
        assert "renewal failed" in log, log
        # etcd keeps leases across its restart (their TTL starts over): renewed or new.
        assert "renewal works again" in log or "registered again" in log, log
        assert "Traceback" not in log
    finally:
        if not store.running:
            store.start()
        areal("stop", "default/trial0", check=0)
