"""The etcd registry against a real etcd: leases that etcd expires itself, auth, TLS, and
outages (an endpoint that does not answer, etcd killed and started again)."""

from __future__ import annotations

import os
import socket
import time

import pytest
from services import EtcdError, b64, make_ca

from areal_cli import settings
from areal_cli.errors import UsageError, WaitTimeout
from areal_cli.registry import RankEntry, ServerEntry, open_registry
from areal_cli.registry.etcd import LeaseExpired

USER = settings.user()
BASE = f"{USER}/e/t"


def entry(port, **kw):
    return ServerEntry(
        id=f"127.0.0.1_{port}", addr=f"127.0.0.1:{port}", experiment="e", trial="t",
        backend="hf", host=settings.hostname(), pid=os.getpid(), **kw,
    )  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- leases -----------------------------------------------------------------------------------


def test_an_unrenewed_lease_drops_the_entry_within_ttl_plus_one_second(etcd):
    reg = open_registry(etcd.url)
    e = entry(30000)
    # A heartbeat from long ago would make a reader guess "dead": the lease alone decides.
    reg.register(e, ttl=2)
    t0 = time.monotonic()
    assert [s.addr for s in reg.list("e", "t").servers] == ["127.0.0.1:30000"]
    while etcd.get_prefix(BASE):
        assert time.monotonic() - t0 < 2 + 1, "still registered after TTL + 1 s"
        time.sleep(0.05)
    gone_after = time.monotonic() - t0
    assert gone_after >= 1.5  # not before its TTL (whole seconds, etcd's 0.5 s tick)
    assert reg.list("e", "t", include_dead=True).servers == []
    with pytest.raises(LeaseExpired):
        reg.keepalive(e)


def test_revoking_removes_at_once_and_renewing_a_revoked_lease_says_so(etcd):
    reg = open_registry(etcd.url)
    e = entry(30001)
    reg.register(e, ttl=30)
    rank = RankEntry(experiment="e", trial="t", rank=0, local_rank=0, world_size=1,
                     host=settings.hostname(), pid=os.getpid())  # fmt: skip
    reg.register_rank(rank, ttl=30)
    assert e.lease and rank.lease and e.lease != rank.lease
    reg._revoke(e.lease)  # the server's two keys go with their lease, in one step
    assert sorted(etcd.get_prefix(BASE)) == [f"{BASE}/areal/ranks/0"]
    with pytest.raises(LeaseExpired):
        reg.keepalive(e)
    reg.deregister_rank(rank)
    assert etcd.get_prefix(USER) == {}
    assert etcd.post("/v3/lease/leases", {}).get("leases", []) == []
    reg._revoke(e.lease)  # revoking again is no error: the keys are gone either way


def test_deregister_job_revokes_its_leases(etcd):
    reg = open_registry(etcd.url)
    reg.register(entry(30002, marker="job"), ttl=30)
    reg.register(entry(30003, marker="other"), ttl=30)
    assert reg.deregister_job("e", "t", "job") == 1
    assert len(etcd.post("/v3/lease/leases", {}).get("leases", [])) == 1
    assert [s.addr for s in reg.list("e", "t").servers] == ["127.0.0.1:30003"]


# -- auth ---------------------------------------------------------------------------------------


def test_auth_right_password_from_env_or_file(etcd_factory, monkeypatch, tmp_path):
    server = etcd_factory(auth=True)
    url = f"etcd://{server.user}@127.0.0.1:{server.client_port}"
    monkeypatch.setenv("AREAL_ETCD_PASSWORD", server.password)
    reg = open_registry(url)
    reg.register(entry(30010))
    assert reg.url == url and server.password not in repr(vars(reg))
    monkeypatch.delenv("AREAL_ETCD_PASSWORD")
    pw = tmp_path / "etcd-password"
    pw.write_text(server.password + "\n")
    reg2 = open_registry(f"{url}?password_file={pw}")
    assert [s.addr for s in reg2.list("e", "t").servers] == ["127.0.0.1:30010"]


def test_auth_wrong_or_missing_credentials_are_usage_errors(etcd_factory, monkeypatch):
    server = etcd_factory(auth=True)
    hostport = f"127.0.0.1:{server.client_port}"
    monkeypatch.setenv("AREAL_ETCD_PASSWORD", "not-the-password")
    with pytest.raises(UsageError) as info:
        open_registry(f"etcd://{server.user}@{hostport}").list()
    assert info.value.exit_code == 2
    assert f"etcd://{server.user}@{hostport}" in info.value.message
    assert "wrong user name or password" in info.value.message
    assert "not-the-password" not in f"{info.value.message} {info.value.hint}"
    with pytest.raises(UsageError, match="requires a user and password"):
        open_registry(f"etcd://{hostport}").list()


def test_auth_logs_in_again_when_the_token_dies(etcd_factory, monkeypatch):
    server = etcd_factory(auth=True)
    monkeypatch.setenv("AREAL_ETCD_PASSWORD", server.password)
    reg = open_registry(f"etcd://{server.user}@127.0.0.1:{server.client_port}")
    e = entry(30011)
    reg.register(e)
    old = reg._client._token
    server.restart()  # simple tokens live in etcd's memory: every one is now invalid
    with pytest.raises(EtcdError, match="invalid auth token"):
        server.post("/v3/kv/range", {"key": "AA=="}, token=old)
    reg.keepalive(e)
    assert [s.addr for s in reg.list("e", "t").servers] == ["127.0.0.1:30011"]
    assert reg._client._token != old


def test_a_user_allowed_only_its_own_keys(etcd_factory, monkeypatch):
    server = etcd_factory(auth=True)
    root = server.authenticate("root", server.root_password)
    mine = {"key": b64(f"{USER}/"), "range_end": b64(f"{USER}0")}
    for path, body in [
        ("/v3/auth/role/add", {"name": "own-keys"}),
        ("/v3/auth/role/grant", {"name": "own-keys", "perm": {"permType": "READWRITE", **mine}}),
        ("/v3/auth/user/add", {"name": "limited", "password": "pw-of-limited"}),
        ("/v3/auth/user/grant", {"user": "limited", "role": "own-keys"}),
    ]:
        server.post(path, body, token=root)
    monkeypatch.setenv("AREAL_ETCD_PASSWORD", "pw-of-limited")
    url = f"etcd://limited@127.0.0.1:{server.client_port}"
    reg = open_registry(url)
    reg.register(entry(30012))
    assert [s.addr for s in reg.list("e", "t").servers] == ["127.0.0.1:30012"]
    assert reg.users() == [USER]  # it may not list the keyspace: it sees itself
    with pytest.raises(UsageError, match="denied user 'limited'") as info:
        reg.for_user("alice").list()
    assert url in info.value.message and info.value.exit_code == 2


def test_a_user_on_an_etcd_without_auth_is_a_usage_error(etcd, monkeypatch):
    monkeypatch.setenv("AREAL_ETCD_PASSWORD", "x")
    with pytest.raises(UsageError, match="does not use authentication"):
        open_registry(f"etcd://someone@127.0.0.1:{etcd.client_port}").list()


# -- TLS ------------------------------------------------------------------------------------------


def test_tls_with_the_right_ca_works_and_a_wrong_ca_is_refused(etcd_factory, tmp_path):
    server = etcd_factory(tls=True)
    hostport = f"127.0.0.1:{server.client_port}"
    reg = open_registry(f"etcd://{hostport}?ca={server.ca_file}")
    reg.register(entry(30020))
    assert [s.addr for s in reg.list("e", "t").servers] == ["127.0.0.1:30020"]

    wrong = make_ca(tmp_path / "other-ca", "another CA")
    with pytest.raises(UsageError) as info:
        open_registry(f"etcd://{hostport}?ca={wrong}").list()
    assert info.value.exit_code == 2 and hostport in info.value.message
    assert "not trusted" in info.value.message

    with pytest.raises(UsageError, match="speaks TLS only") as info:
        open_registry(f"etcd://{hostport}").list()
    assert "ca=" in info.value.hint


def test_tls_against_a_plain_etcd_is_refused(etcd_factory, tmp_path):
    plain = etcd_factory()
    ca = make_ca(tmp_path / "ca")
    with pytest.raises(UsageError, match="TLS with .* failed"):
        open_registry(f"etcd://127.0.0.1:{plain.client_port}?ca={ca}").list()


# -- outages ------------------------------------------------------------------------------------


def test_an_unreachable_endpoint_is_a_fast_timeout_naming_the_url():
    url = f"etcd://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(WaitTimeout) as info:
        open_registry(url).list("e", "t")
    assert time.monotonic() - t0 < 1
    assert info.value.exit_code == 3 and url in info.value.message
    assert "connection refused" in info.value.message


def test_an_endpoint_that_never_answers_is_bounded_by_the_read_timeout():
    with socket.socket() as silent:  # accepts connections (the kernel does), never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"etcd://127.0.0.1:{silent.getsockname()[1]}?timeout=0.5"
        t0 = time.monotonic()
        with pytest.raises(WaitTimeout, match="timed out"):
            open_registry(url).list()
        assert time.monotonic() - t0 < 2


def test_failover_to_the_next_endpoint(etcd):
    reg = open_registry(f"etcd://127.0.0.1:{free_port()},127.0.0.1:{etcd.client_port}")
    reg.register(entry(30030))
    assert [s.addr for s in reg.list("e", "t").servers] == ["127.0.0.1:30030"]
    assert reg._client._current == 1  # and it stays with the one that answered


def test_etcd_killed_and_started_again(etcd_factory):
    server = etcd_factory()
    reg = open_registry(server.url)
    e = entry(30040)
    reg.register(e, ttl=30)
    server.kill()
    for op in (
        lambda: reg.list("e", "t"),
        lambda: reg.keepalive(e),
        lambda: reg.register(entry(1)),
    ):
        t0 = time.monotonic()
        with pytest.raises(WaitTimeout) as info:
            op()
        assert server.url in info.value.message and time.monotonic() - t0 < 1
    server.start()
    # The lease outlived the outage (etcd restores leases from its data with a fresh TTL).
    reg.keepalive(e)
    reg.register(entry(30041), ttl=30)
    assert [s.addr for s in reg.list("e", "t").servers] == ["127.0.0.1:30040", "127.0.0.1:30041"]
