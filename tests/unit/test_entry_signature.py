"""Registry entries signed with their job's API key: what discovery checks before a request
carries the key (the etcd attack itself, with another uid and a real etcd, is in
tests/integration/test_etcd_shared.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import time

from areal_cli import apikeys, discovery, settings
from areal_cli.registry import FileRegistry, ServerEntry

KEY = "k3y-of-the-job"


def entry(port=30000, **kw) -> ServerEntry:
    return ServerEntry(
        id=f"127.0.0.1_{port}", addr=f"127.0.0.1:{port}", experiment="e", trial="t",
        backend="hf", host=settings.hostname(), pid=os.getpid(), api_key_required=True,
        job="e/t", marker="m-1", **kw,
    )  # fmt: skip


def test_a_signed_entry_proves_itself_and_any_change_to_where_or_whose_breaks_it(tmp_path):
    reg = FileRegistry(tmp_path)
    reg.register(entry(), ttl=30, sign_with=KEY)
    (e,) = reg.list("e", "t").servers
    assert KEY not in json.dumps(e.to_json())
    assert apikeys.unproven(KEY, e) is None
    assert "does not match" in apikeys.unproven("another-key", e)
    for change in ({"addr": "127.0.0.1:9"}, {"id": "copy"}, {"marker": "m-2"}, {"job": "x/y"},
                   {"ttl": 3600.0}, {"heartbeat": time.time()}):  # fmt: skip
        assert "does not match" in apikeys.unproven(KEY, dataclasses.replace(e, **change))
    assert "not signed" in apikeys.unproven(KEY, dataclasses.replace(e, signature=None))


def test_a_signature_is_renewed_with_the_heartbeat_and_goes_stale_without_it(tmp_path):
    reg = FileRegistry(tmp_path)
    mine = entry()
    reg.register(mine, ttl=1, sign_with=KEY)
    first = reg.list("e", "t").servers[0].signature
    time.sleep(0.05)
    reg.keepalive(mine, sign_with=KEY)
    (e,) = reg.list("e", "t").servers
    assert e.signature != first and apikeys.unproven(KEY, e) is None
    assert "last signed 2s ago" in apikeys.unproven(KEY, e, now=e.heartbeat + 2)


def test_discovery_hands_the_key_only_to_entries_that_prove_their_job(tmp_path):
    home = tmp_path / "home"
    apikeys.store(apikeys.key_file(home, "e", "t"), "m-1", KEY)
    reg = FileRegistry(tmp_path / "reg")
    reg.register(entry(30000), ttl=30, sign_with=KEY)
    reg.register(entry(30001), ttl=30)  # the same job's fields, no signature
    (good,) = [e for e in reg.list("e", "t").servers if e.signature]
    forged = dataclasses.replace(good, id="copy", addr="127.0.0.1:9")  # a copy, elsewhere
    same_addr = dataclasses.replace(good, id="copy2", signature="0" * 64)
    use, key, skipped = discovery.trusted(home, [forged, same_addr, *reg.list("e", "t").servers])
    assert [e.addr for e in use] == ["127.0.0.1:30000"] and key == KEY
    assert dict(skipped) == {
        "127.0.0.1:9": "its registry entry's signature does not match (copied, or pointed elsewhere)",
        "127.0.0.1:30000": "its registry entry's signature does not match (copied, or pointed elsewhere)",
        "127.0.0.1:30001": "its registry entry is not signed by the job that holds the key",
    }  # fmt: skip
