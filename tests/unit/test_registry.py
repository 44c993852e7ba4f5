"""The registry: AReaL's layout, liveness, leases, ranks, and reading untrusted files safely."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from areal_cli import settings
from areal_cli.registry import FileRegistry, RankEntry, ServerEntry, open_registry

USER = settings.user()


def entry(port, pid=None, **kw):
    return ServerEntry(
        id=f"127.0.0.1_{port}", addr=f"127.0.0.1:{port}", experiment="e", trial="t",
        backend="hf", host=settings.hostname(), pid=pid or os.getpid(), **kw,
    )  # fmt: skip


@pytest.fixture
def reg(tmp_path):
    return open_registry(str(tmp_path / "reg"))


def test_layout_is_areals(tmp_path):
    reg = FileRegistry(tmp_path)
    reg.register(entry(30000))
    d = tmp_path / USER / "e" / "t" / "gen_servers" / "127.0.0.1_30000"
    # AReaL's reader takes directories holding exactly one file named ENTRY.
    assert os.listdir(d) == ["ENTRY"] and (d / "ENTRY").read_text() == "127.0.0.1:30000"
    # Our metadata never starts with the gen_servers prefix (AReaL reads that prefix).
    meta = json.loads((tmp_path / USER / "e/t/areal/servers/127.0.0.1_30000/ENTRY").read_text())
    assert meta["backend"] == "hf" and meta["pid"] == os.getpid()
    assert sorted(os.listdir(tmp_path / USER / "e" / "t")) == ["areal", "gen_servers"]
    assert [e.addr for e in reg.list("e", "t").servers] == ["127.0.0.1:30000"]
    reg.deregister("e", "t", "127.0.0.1_30000")
    assert not (tmp_path / USER).exists()  # empty parents pruned


def test_the_user_directory_is_private_and_the_root_shared(tmp_path):
    root = tmp_path / "reg"
    FileRegistry(root).register(entry(30000))
    assert oct(os.stat(root).st_mode & 0o7777) == oct(0o1777)
    assert oct(os.stat(root / USER).st_mode & 0o777) == oct(0o700)


def test_dead_pid_and_stale_heartbeat_are_never_returned(reg):
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    reg.register(entry(30001, pid=p.pid))
    reg.register(entry(30002), ttl=0.01)
    reg.register(entry(30003))
    time.sleep(0.05)
    listing = reg.list("e", "t")
    assert [e.addr for e in listing.servers] == ["127.0.0.1:30003"]
    assert sorted(r for _, r in listing.skipped) == ["dead", "dead"]
    assert reg.prune() == 2
    assert len(reg.list("e", "t", include_dead=True).servers) == 1


def test_keepalive_renews_and_updates_metadata(reg):
    e = entry(30006)
    reg.register(e, ttl=0.3)
    time.sleep(0.2)
    reg.keepalive(e, weight_version="3")
    time.sleep(0.2)
    (got,) = reg.list("e", "t").servers  # alive: renewed within its TTL
    assert got.heartbeat >= e.heartbeat - 1e-6 and got.weight_version == "3"


def test_corrupt_and_half_written_entries_are_skipped(tmp_path):
    reg = FileRegistry(tmp_path)
    reg.register(entry(30004))
    base = tmp_path / USER / "e" / "t"
    (base / "gen_servers/bad_value").mkdir(parents=True)
    (base / "gen_servers/bad_value/ENTRY").write_text("not an address")
    (base / "gen_servers/half").mkdir()
    (base / "gen_servers/half/ENTRY.tmp.1234").write_text("127.0.0.1:1")
    (base / "gen_servers/badmeta").mkdir()
    (base / "gen_servers/badmeta/ENTRY").write_text("127.0.0.1:30005")
    (base / "areal/servers/badmeta").mkdir(parents=True)
    (base / "areal/servers/badmeta/ENTRY").write_text('{"pid": 1, "trunc')
    listing = reg.list("e", "t")
    assert [e.addr for e in listing.servers] == ["127.0.0.1:30004"]
    reasons = {os.path.basename(k): r for k, r in listing.skipped}
    assert reasons["half"] == "half-written"
    assert reasons["badmeta"] == "corrupt metadata"
    assert "not host:port" in reasons["bad_value"]


def test_entries_written_by_areal_itself_are_listed(tmp_path):
    d = tmp_path / USER / "e" / "t" / "gen_servers" / "areal-0"
    d.mkdir(parents=True)
    (d / "ENTRY").write_text("10.0.0.5:30000")
    (only,) = FileRegistry(tmp_path).list().servers
    assert only.addr == "10.0.0.5:30000" and only.managed is False


def test_deregister_job_leaves_other_jobs_entries(reg):
    for port, marker in ((1, "serve-job"), (2, "train-job")):
        reg.register(entry(port, marker=marker))
    assert reg.deregister_job("e", "t", "train-job") == 1
    assert [e.addr for e in reg.list("e", "t").servers] == ["127.0.0.1:1"]


def test_ranks_are_recorded_while_they_live(reg):
    mine = RankEntry(experiment="e", trial="t", rank=1, local_rank=1, world_size=2,
                     host=settings.hostname(), pid=os.getpid(), marker="m")  # fmt: skip
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    gone = RankEntry(experiment="e", trial="t", rank=0, local_rank=0, world_size=2,
                     host=settings.hostname(), pid=p.pid, marker="m")  # fmt: skip
    reg.register_rank(mine)
    reg.register_rank(gone)
    assert [r.rank for r in reg.ranks("e", "t")] == [1]
    assert [r.rank for r in reg.ranks("e", "t", include_dead=True)] == [0, 1]
    # Ranks are not servers: AReaL's prefix read of gen_servers never sees them.
    assert reg.list("e", "t").servers == []
    reg.deregister_job("e", "t", "m")
    assert reg.ranks("e", "t", include_dead=True) == []


def test_probe_writes_reads_and_cleans(reg, tmp_path):
    reg.probe()
    assert not list((tmp_path / "reg").glob(f"{USER}/*"))


# -- untrusted files: nothing is read through a symlink, from a FIFO, or without a size cap --


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
    os.chmod(d, 0o777)
    assert reg.list().servers == []
    os.chmod(d, 0o755)
    assert len(reg.list().servers) == 1
