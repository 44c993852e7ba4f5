import json
import os
import subprocess
import sys
import time

from areal_cli import settings
from areal_cli.registry import FileRegistry, ServerEntry


def entry(port, pid=None, **kw):
    return ServerEntry(
        id=f"127.0.0.1_{port}", addr=f"127.0.0.1:{port}", experiment="e", trial="t",
        backend="hf", host=settings.hostname(), pid=pid or os.getpid(), **kw,
    )  # fmt: skip


def test_layout_is_areals(tmp_path):
    reg = FileRegistry(tmp_path, user="u")
    reg.register(entry(30000))
    d = tmp_path / "u" / "e" / "t" / "gen_servers" / "127.0.0.1_30000"
    # AReaL's reader takes directories holding exactly one file named ENTRY.
    assert os.listdir(d) == ["ENTRY"] and (d / "ENTRY").read_text() == "127.0.0.1:30000"
    meta = json.loads((tmp_path / "u/e/t/gen_servers_meta/127.0.0.1_30000/ENTRY").read_text())
    assert meta["backend"] == "hf" and meta["pid"] == os.getpid()
    assert [e.addr for e in reg.list("e", "t").servers] == ["127.0.0.1:30000"]
    reg.deregister("e", "t", "127.0.0.1_30000")
    assert not (tmp_path / "u").exists()  # empty parents pruned


def test_dead_pid_and_stale_heartbeat_are_never_returned(tmp_path):
    reg = FileRegistry(tmp_path)
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    reg.register(entry(30001, pid=p.pid))
    reg.register(entry(30002, ttl=0.01))
    reg.register(entry(30003))
    time.sleep(0.05)
    listing = reg.list("e", "t")
    assert [e.addr for e in listing.servers] == ["127.0.0.1:30003"]
    assert sorted(r for _, r in listing.skipped) == ["dead", "dead"]
    assert reg.prune() == 2
    assert len(reg.list("e", "t", include_dead=True).servers) == 1


def test_corrupt_and_half_written_entries_are_skipped(tmp_path):
    reg = FileRegistry(tmp_path, user="u")
    reg.register(entry(30004))
    base = tmp_path / "u" / "e" / "t"
    (base / "gen_servers/bad_value").mkdir(parents=True)
    (base / "gen_servers/bad_value/ENTRY").write_text("not an address")
    (base / "gen_servers/half").mkdir()
    (base / "gen_servers/half/ENTRY.tmp.1234").write_text("127.0.0.1:1")
    (base / "gen_servers/badmeta").mkdir()
    (base / "gen_servers/badmeta/ENTRY").write_text("127.0.0.1:30005")
    (base / "gen_servers_meta/badmeta").mkdir(parents=True)
    (base / "gen_servers_meta/badmeta/ENTRY").write_text('{"pid": 1, "trunc')
    listing = reg.list("e", "t")
    assert [e.addr for e in listing.servers] == ["127.0.0.1:30004"]
    reasons = dict((os.path.basename(p), r) for p, r in listing.skipped)
    assert reasons["half"] == "half-written"
    assert reasons["badmeta"] == "corrupt metadata"
    assert "not host:port" in reasons["bad_value"]


def test_entries_written_by_areal_itself_are_listed(tmp_path):
    d = tmp_path / "u" / "e" / "t" / "gen_servers" / "areal-0"
    d.mkdir(parents=True)
    (d / "ENTRY").write_text("10.0.0.5:30000")
    (only,) = FileRegistry(tmp_path, user="u").list().servers
    assert only.addr == "10.0.0.5:30000" and only.managed is False


def test_heartbeat_updates_metadata(tmp_path):
    reg = FileRegistry(tmp_path)
    e = entry(30006)
    reg.register(e)
    first = e.heartbeat
    time.sleep(0.01)
    reg.heartbeat(e, weight_version="3")
    (got,) = reg.list("e", "t").servers
    assert got.heartbeat > first and got.weight_version == "3"
