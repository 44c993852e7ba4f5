"""The registry on both backends (file and etcd): AReaL's keys, liveness, leases, ranks, and
concurrent writers; then what only the file backend has (its layout on disk, and reading
untrusted files safely). etcd's own faults (auth, TLS, outages) are in
tests/integration/test_registry_etcd.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from areal_cli import settings
from areal_cli.errors import UsageError
from areal_cli.registry import FileRegistry, RankEntry, Registry, ServerEntry, open_registry

USER = settings.user()
BASE = f"{USER}/e/t"


def entry(port, pid=None, **kw):
    return ServerEntry(
        id=f"127.0.0.1_{port}", addr=f"127.0.0.1:{port}", experiment="e", trial="t",
        backend="hf", host=settings.hostname(), pid=pid or os.getpid(), **kw,
    )  # fmt: skip


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@dataclass
class Backend:
    reg: Registry
    # AReaL's own read of a name root, outside our code: {key: value}. On etcd a plain prefix
    # read with no trailing slash (Etcd3NameRecordRepository.get_subtree), on files a walk
    # taking directories that hold exactly one ENTRY (NfsNameRecordRepository.get_subtree).
    areal_read: Callable[[str], dict[str, str]]
    # A write that bypasses our code (AReaL's, or anyone's).
    raw_put: Callable[[str, str], None]
    # The shortest TTL the backend honours, and how long after it an entry may linger.
    short_ttl: float
    expiry_slack: float


def _file_backend(root: Path) -> Backend:
    def areal_read(name_root: str) -> dict[str, str]:
        out = {}
        for d, _, files in os.walk(root / name_root):
            if files == ["ENTRY"]:
                out[os.path.relpath(d, root)] = Path(d, "ENTRY").read_text()
        return out

    def raw_put(key: str, value: str) -> None:
        (root / key).mkdir(parents=True, exist_ok=True)
        (root / key / "ENTRY").write_text(value)
        os.chmod(root / USER, 0o700)

    return Backend(open_registry(str(root)), areal_read, raw_put, short_ttl=0.5, expiry_slack=0)


@pytest.fixture(params=["file", pytest.param("etcd", marks=pytest.mark.etcd)])
def backend(request, tmp_path):
    if request.param == "file":
        yield _file_backend(tmp_path / "reg")
        return
    server = request.getfixturevalue("etcd")
    reg = open_registry(server.url)
    # etcd counts whole seconds and expires leases on a 0.5 s tick.
    yield Backend(reg, server.get_prefix, server.put, short_ttl=1, expiry_slack=1)
    reg.close()


@pytest.fixture
def reg(backend):
    return backend.reg


def wait_until(predicate, timeout: float, interval: float = 0.05) -> float:
    """Seconds until predicate() held; fails after `timeout`."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"not within {timeout} s")
        time.sleep(interval)
    return time.monotonic() - t0


# -- AReaL's keys ---------------------------------------------------------------------------


def test_keys_are_areals_names_and_its_prefix_read_sees_only_addresses(backend):
    reg = backend.reg
    reg.register(entry(30000))
    reg.register_rank(RankEntry(experiment="e", trial="t", rank=0, local_rank=0, world_size=1,
                                host=settings.hostname(), pid=os.getpid()))  # fmt: skip
    # AReaL reads `<user>/<E>/<T>/gen_servers` as a plain prefix: our metadata and ranks never
    # start with it, so it sees nothing but the address.
    assert backend.areal_read(f"{BASE}/gen_servers") == {
        f"{BASE}/gen_servers/127.0.0.1_30000": "127.0.0.1:30000"
    }
    everything = backend.areal_read(BASE)
    assert sorted(everything) == [
        f"{BASE}/areal/ranks/0",
        f"{BASE}/areal/servers/127.0.0.1_30000",
        f"{BASE}/gen_servers/127.0.0.1_30000",
    ]
    meta = json.loads(everything[f"{BASE}/areal/servers/127.0.0.1_30000"])
    assert meta["backend"] == "hf" and meta["pid"] == os.getpid()
    assert [e.addr for e in reg.list("e", "t").servers] == ["127.0.0.1:30000"]
    reg.deregister("e", "t", "127.0.0.1_30000", reg.list("e", "t").servers[0].lease)
    reg.deregister_rank(reg.ranks("e", "t")[0])
    assert backend.areal_read(USER) == {}


def test_entries_written_by_areal_itself_are_listed(backend):
    # AReaL's add_subentry: `<gen_servers>/<uuid8>`, the address as the value, no metadata.
    backend.raw_put(f"{BASE}/gen_servers/5f1c2a9e", "10.0.0.5:30000")
    (only,) = backend.reg.list().servers
    assert only.addr == "10.0.0.5:30000" and only.managed is False and only.id == "5f1c2a9e"


def test_corrupt_entries_are_skipped(backend):
    reg = backend.reg
    reg.register(entry(30004))
    backend.raw_put(f"{BASE}/gen_servers/bad_value", "not an address")
    backend.raw_put(f"{BASE}/gen_servers/badmeta", "127.0.0.1:30005")
    backend.raw_put(f"{BASE}/areal/servers/badmeta", '{"pid": 1, "trunc')
    listing = reg.list("e", "t")
    assert [e.addr for e in listing.servers] == ["127.0.0.1:30004"]
    reasons = {k.rpartition("/")[2]: r for k, r in listing.skipped}
    assert reasons["badmeta"] == "corrupt metadata"
    assert "not host:port" in reasons["bad_value"]


def test_where_and_areal_overrides_name_this_registry(backend):
    reg = backend.reg
    assert f"{USER}/e/t" in reg.where("e", "t") and reg.url in reg.where("e", "t")
    overrides = reg.areal_name_resolve()
    if reg.kind == "file":
        assert overrides == [
            "cluster.name_resolve.type=nfs",
            f"cluster.name_resolve.nfs_record_root={reg.url}",
        ]
    else:
        # AReaL's NameResolveConfig: type "etcd3", etcd3_addr "host:port" (one endpoint).
        assert overrides == [
            "cluster.name_resolve.type=etcd3",
            f"cluster.name_resolve.etcd3_addr={reg.url.removeprefix('etcd://')}",
        ]


def test_users_are_those_with_entries(backend):
    backend.reg.register(entry(30020))
    backend.reg.for_user("alice").register(entry(30021))
    assert backend.reg.users() == sorted([USER, "alice"])
    assert [e.addr for e in backend.reg.list().servers] == ["127.0.0.1:30020"]


# -- liveness -------------------------------------------------------------------------------


def test_dead_pids_and_unrenewed_entries_are_never_returned(backend):
    reg = backend.reg
    reg.register(entry(30001, pid=dead_pid()))
    reg.register(entry(30002), ttl=backend.short_ttl)  # never renewed
    reg.register(entry(30003))
    # A dead pid on this host is judged at once, on both backends.
    listing = reg.list("e", "t")
    assert "127.0.0.1:30003" in {e.addr for e in listing.servers}
    assert (f"{BASE}/gen_servers/127.0.0.1_30001", "dead") in listing.skipped
    wait_until(
        lambda: [e.addr for e in reg.list("e", "t").servers] == ["127.0.0.1:30003"],
        backend.short_ttl + backend.expiry_slack + 1,
    )
    if reg.kind == "etcd":
        # etcd dropped the keys with their lease: no reader judged anything.
        assert not any("30002" in k for k in backend.areal_read(BASE))
        assert reg.prune() == 1
    else:
        # Files stay until pruned; readers skip them by their stale heartbeat.
        assert sorted(r for _, r in reg.list("e", "t").skipped) == ["dead", "dead"]
        assert reg.prune() == 2
    assert [e.addr for e in reg.list("e", "t", include_dead=True).servers] == ["127.0.0.1:30003"]


def test_keepalive_renews_and_updates_metadata(backend):
    reg, ttl = backend.reg, backend.short_ttl
    e = entry(30006)
    reg.register(e, ttl=ttl)
    t_end = time.monotonic() + 2 * ttl + backend.expiry_slack
    while time.monotonic() < t_end:
        time.sleep(ttl / 3)
        reg.keepalive(e)
    reg.keepalive(e, weight_version="3")
    (got,) = reg.list("e", "t").servers  # alive: renewed within its TTL all along
    assert got.weight_version == "3" and got.heartbeat >= e.heartbeat - 1e-6
    if reg.kind == "etcd":
        assert got.lease == e.lease  # one lease, renewed; not re-registered


def test_deregister_job_leaves_other_jobs_entries(reg):
    for port, marker in ((1, "serve-job"), (2, "train-job")):
        reg.register(entry(port, marker=marker))
    assert reg.deregister_job("e", "t", "train-job") == 1
    assert [e.addr for e in reg.list("e", "t").servers] == ["127.0.0.1:1"]


def test_ranks_are_recorded_while_they_live(backend):
    reg = backend.reg
    mine = RankEntry(experiment="e", trial="t", rank=1, local_rank=1, world_size=2,
                     host=settings.hostname(), pid=os.getpid(), marker="m")  # fmt: skip
    gone = RankEntry(experiment="e", trial="t", rank=0, local_rank=0, world_size=2,
                     host=settings.hostname(), pid=dead_pid(), marker="m")  # fmt: skip
    reg.register_rank(mine)
    reg.register_rank(gone)
    reg.keepalive_rank(mine)
    assert [r.rank for r in reg.ranks("e", "t")] == [1]
    assert [r.rank for r in reg.ranks("e", "t", include_dead=True)] == [0, 1]
    # Ranks are not servers: AReaL's prefix read of gen_servers never sees them.
    assert reg.list("e", "t").servers == []
    assert backend.areal_read(f"{BASE}/gen_servers") == {}
    reg.deregister_job("e", "t", "m")
    assert reg.ranks("e", "t", include_dead=True) == []
    assert backend.areal_read(USER) == {}


def test_probe_writes_reads_and_cleans(backend):
    backend.reg.probe()
    assert backend.areal_read(USER) == {}


_WRITER = """
import os, sys
from areal_cli import settings
from areal_cli.registry import ServerEntry, open_registry
url, n, base, owner = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
reg = open_registry(url)
for i in range(n):
    reg.register(ServerEntry(id=f"w_{base + i}", addr=f"127.0.0.1:{base + i}", experiment="e",
                             trial="t", host=settings.hostname(), pid=owner))
"""


def test_concurrent_registration_from_several_processes(reg):
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, reg.url, "15", str(20000 + 100 * k), str(os.getpid())]
        )
        for k in range(4)
    ]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0, 0]
    listing = reg.list("e", "t")
    assert len(listing.servers) == 60 and listing.skipped == []
    assert len({e.addr for e in listing.servers}) == 60
    assert all(e.managed and e.pid == os.getpid() for e in listing.servers)


_PROBER = """
import sys
from areal_cli.registry import open_registry
reg = open_registry(sys.argv[1])
for _ in range(int(sys.argv[2])):
    reg.probe()
"""


def test_concurrent_probes_on_a_fresh_root_never_pull_folders_from_under_each_other(tmp_path):
    # Two `areal serve` started together each probe the registry; one probe's cleanup
    # once removed the folders the other was writing into (ENOENT: "cannot write the
    # registry").
    url = str(tmp_path / "fresh")
    procs = [
        subprocess.Popen([sys.executable, "-c", _PROBER, url, "150"], stderr=subprocess.PIPE)
        for _ in range(3)
    ]
    errs = [p.communicate(timeout=60)[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errs
    assert FileRegistry(url).list("e", "t").servers == []


# -- URLs -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url, says",
    [
        ("etcd://", "no host"),
        ("etcd://:2379", "no host"),
        ("etcd://host:0", "port '0'"),
        ("etcd://host:99999", "port '99999'"),
        ("etcd://host:abc", "port 'abc'"),
        ("etcd://ho_st:2379", "not a host name"),
        ("etcd://[zz::1]:2379", "not an IPv6 address"),
        ("etcd://host:2379,", "no host"),
        ("etcd://host:2379/prefix", "a path is not part"),
        ("etcd://host:2379?cafile=x", "unknown parameter cafile"),
        ("etcd://host:2379?timeout=0", "timeout=0"),
        ("etcd://host:2379?connect_timeout=x", "connect_timeout=x"),
        ("etcd://host:2379?tls=yes", "tls=yes"),
        ("etcd://@host:2379", "empty user name"),
        ("etcd://host:2379?password_file=/x", "without a user"),
        ("etcd://host:2379?ca=/nonexistent/ca.pem", "no CA file"),
        ("etcd://host:2379?ca=", "ca= names no file"),
        ("etcd://host:2379?ca=/etc/hostname", "cannot load the CA file"),
    ],
)
def test_bad_etcd_urls_are_usage_errors(url, says):
    with pytest.raises(UsageError) as info:
        open_registry(url)
    assert info.value.exit_code == 2 and says in info.value.message
    assert url in info.value.message


def test_a_password_in_the_url_is_refused_and_never_repeated(monkeypatch, tmp_path):
    with pytest.raises(UsageError) as info:
        open_registry("etcd://areal:hunter2@host:2379")
    assert "hunter2" not in f"{info.value.message} {info.value.hint}"
    assert "AREAL_ETCD_PASSWORD" in info.value.message
    # A user needs a password from the environment or a file, never from the URL.
    monkeypatch.delenv("AREAL_ETCD_PASSWORD", raising=False)
    with pytest.raises(UsageError, match="names user 'areal' but no password"):
        open_registry("etcd://areal@host:2379")
    (tmp_path / "pw").write_text("hunter2\n")
    reg = open_registry(f"etcd://areal@host:2379?password_file={tmp_path / 'pw'}")
    assert "hunter2" not in reg.url + repr(reg.__dict__)
    assert reg.kind == "etcd" and reg.url == f"etcd://areal@host:2379?password_file={tmp_path}/pw"


def test_etcd_url_forms():
    reg = open_registry("etcd://h1,h2:2380,[::1]:2381?timeout=1.5&connect_timeout=0.5")
    c = reg._client
    assert c.endpoints == [("h1", 2379), ("h2", 2380), ("::1", 2381)]
    assert (c.read_timeout, c.connect_timeout) == (1.5, 0.5)
    assert reg.areal_name_resolve()[1] == "cluster.name_resolve.etcd3_addr=h1:2379"


# -- the file backend only: its layout on disk, and untrusted files ----------------------------


def test_file_layout_on_disk(tmp_path):
    reg = FileRegistry(tmp_path)
    reg.register(entry(30000))
    d = tmp_path / USER / "e" / "t" / "gen_servers" / "127.0.0.1_30000"
    # AReaL's reader takes directories holding exactly one file named ENTRY.
    assert os.listdir(d) == ["ENTRY"] and (d / "ENTRY").read_text() == "127.0.0.1:30000"
    assert sorted(os.listdir(tmp_path / USER / "e" / "t")) == ["areal", "gen_servers"]
    reg.deregister("e", "t", "127.0.0.1_30000")
    # Empty parents are pruned up to the user's folder, which keeps its ownership.
    assert os.listdir(tmp_path / USER) == []


def test_the_user_directory_is_private_and_the_root_shared(tmp_path):
    root = tmp_path / "reg"
    FileRegistry(root).register(entry(30000))
    assert oct(os.stat(root).st_mode & 0o7777) == oct(0o1777)
    assert oct(os.stat(root / USER).st_mode & 0o777) == oct(0o700)


def test_half_written_entries_are_skipped(tmp_path):
    reg = FileRegistry(tmp_path)
    reg.register(entry(30004))
    (tmp_path / BASE / "gen_servers/half").mkdir()
    (tmp_path / BASE / "gen_servers/half/ENTRY.tmp.1234").write_text("127.0.0.1:1")
    listing = reg.list("e", "t")
    assert [e.addr for e in listing.servers] == ["127.0.0.1:30004"]
    assert listing.skipped == [(f"{BASE}/gen_servers/half", "half-written")]


def _plant(tmp_path, name):
    d = tmp_path / USER / "e" / "t" / "gen_servers" / name
    d.mkdir(parents=True)
    os.chmod(tmp_path / USER, 0o700)
    return d / "ENTRY"


def test_a_fifo_entry_is_skipped_without_blocking(tmp_path):
    os.mkfifo(_plant(tmp_path, "fifo"))
    t0 = time.monotonic()
    listing = FileRegistry(tmp_path).list()
    assert time.monotonic() - t0 < 1
    assert listing.servers == [] and "not a regular file" in listing.skipped[0][1]


def test_a_symlinked_entry_is_not_followed(tmp_path):
    os.symlink("/dev/zero", _plant(tmp_path, "zero"))
    listing = FileRegistry(tmp_path).list()
    assert listing.servers == [] and "unreadable ENTRY" in listing.skipped[0][1]


def test_a_huge_entry_is_refused_quickly(tmp_path):
    path = _plant(tmp_path, "huge")
    with open(path, "wb") as f:
        f.truncate(50 * 1024 * 1024)
    t0 = time.monotonic()
    listing = FileRegistry(tmp_path).list()
    assert time.monotonic() - t0 < 1
    assert listing.servers == [] and "larger than" in listing.skipped[0][1]


def test_group_or_world_writable_entries_are_not_trusted(tmp_path):
    reg = FileRegistry(tmp_path)
    reg.register(entry(30010))
    d = tmp_path / USER / "e" / "t" / "gen_servers" / "127.0.0.1_30010"
    os.chmod(d / "ENTRY", 0o666)
    listing = reg.list()
    assert listing.servers == [] and "writable by group or others" in listing.skipped[0][1]
    os.chmod(d / "ENTRY", 0o644)
    assert len(reg.list().servers) == 1
    # A folder others may write to lets them add files, never make theirs pass as ours.
    os.chmod(d, 0o777)
    assert len(reg.list().servers) == 1
    os.chmod(d, 0o755)
    # The user's own folder is the gate: if others may write it, nothing in it is read.
    os.chmod(tmp_path / USER, 0o777)
    listing = reg.list()
    assert listing.servers == [] and "writable by group or others" in listing.skipped[0][1]


def test_the_trials_last_job_takes_what_areals_trainer_wrote_with_it(backend):
    """AReaL's trainer writes keys of its own under the trial (update_weights_from_disk/<n>
    from its disk sync); the stop of the trial's last job removes them, not those of another
    trial, nor while a server of the trial still runs."""
    reg = backend.reg
    areal_keys = [f"{USER}/e/t/update_weights_from_disk/{n}" for n in (0, 1)]
    other = f"{USER}/e/u/update_weights_from_disk/0"
    for key in (*areal_keys, other):
        backend.raw_put(key, "1796450000.5")
    reg.register(entry(1, marker="serve-job"))
    reg.register(entry(2, marker="other-serve-job"))
    assert reg.deregister_job("e", "t", "serve-job") == 1
    assert set(areal_keys) <= set(backend.areal_read(f"{USER}/e/t"))  # a server still runs
    assert reg.deregister_job("e", "t", "other-serve-job") == 1
    assert backend.areal_read(f"{USER}/e/t") == {}
    assert list(backend.areal_read(f"{USER}/e/u")) == [other]
    # Before a run, `areal train --areal-overrides` clears what an earlier trainer left.
    assert reg.clear_foreign("e", "u") == 1 and backend.areal_read(f"{USER}/e/u") == {}
