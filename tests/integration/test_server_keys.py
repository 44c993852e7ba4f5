"""The servers' API key from a user's side: `areal key` hands it to clients of their own, off
every command line, and `areal train` checks it on a guarded route before any rank starts
(/health is open on every engine, so a wrong key used to be an HTTP 401 inside a rank)."""

from __future__ import annotations

import json
import stat
import urllib.error
import urllib.request

import pytest

from tests.helpers import REPO, areal

SCRIPT = str(REPO / "tests" / "fixtures" / "scripts" / "record_env.py")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from areal_cli.modelgen import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=0)


@pytest.fixture
def served(tiny):
    """One real hf server under keys/t0 with the default --api-key auto."""
    out = areal("serve", "--backend", "hf", "--model", str(tiny), "--experiment", "keys",
                "--trial", "t0", "--detach", "--json", check=0, timeout=120)  # fmt: skip
    yield json.loads(out.stdout)["servers"][0]["addr"]
    areal("stop", "keys/t0", check=0, timeout=60)


def _get(addr: str, path: str, key: str | None = None) -> int:
    req = urllib.request.Request(f"http://{addr}{path}")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _train(*args: str, env: dict | None = None, check: int | None = None):
    return areal("train", "--alloc", "fsdp:d1", "--experiment", "keys", "--trial", "t1", *args,
                 SCRIPT, env={"AREAL_API_KEY": "", **(env or {})}, check=check,
                 timeout=120)  # fmt: skip


def test_areal_key_hands_out_the_key_and_train_checks_it_before_any_rank(served, tmp_path):
    """One server for both halves: each start costs seconds."""
    _areal_key_hands_the_key_to_a_client_of_ones_own(served, tmp_path)
    _train_names_a_missing_or_wrong_key_before_any_rank_starts(served, tmp_path)
    _areal_overrides_against_keyed_servers_says_what_to_do(served)


def _areal_key_hands_the_key_to_a_client_of_ones_own(served, tmp_path):
    key = areal("key", "keys/t0", check=0).stdout.strip()
    assert _get(served, "/model_info") == 401 and _get(served, "/model_info", key) == 200
    env_file, header = tmp_path / "areal.env", tmp_path / "areal.hdr"
    areal("key", "keys/t0", "--env-file", str(env_file), "--header-file", str(header), check=0)
    for f in (env_file, header):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert env_file.read_text() == f"AREAL_API_KEY={key}\nOPENAI_API_KEY={key}\n"
    assert header.read_text() == f"Authorization: Bearer {key}\n"
    missing = areal("key", "keys/nope", check=2)
    assert "no API key of keys/nope" in missing.stderr and "Traceback" not in missing.stderr


def _train_names_a_missing_or_wrong_key_before_any_rank_starts(served, tmp_path):
    record = tmp_path / "rec"
    record.mkdir()
    env = {"RECORD_DIR": str(record)}
    none = _train("--servers", served, env=env, check=2)
    assert f"{served} (HTTP 401): want an API key, and none was given" in none.stderr
    assert "AREAL_API_KEY=$(areal key" in none.stderr and "Traceback" not in none.stderr
    wrong = _train("--servers", served, env={**env, "AREAL_API_KEY": "not-the-key"}, check=2)
    assert f"{served} (HTTP 401): refuse the key given" in wrong.stderr
    assert not list(record.iterdir())  # no rank ran
    key = areal("key", "keys/t0", check=0).stdout.strip()
    _train("--servers", served, env={**env, "AREAL_API_KEY": key}, check=0)
    (rank0,) = [json.loads(p.read_text()) for p in record.glob("rank-*.json")]
    assert rank0["env"]["AREAL_API_KEY"] == key


def _areal_overrides_against_keyed_servers_says_what_to_do(served):
    # AReaL's trainer sends no Authorization header (areal/infra/remote_inf_engine.py and
    # areal/infra/utils/http.py:128-175 at inclusionAI/AReaL 4aef98d): it would get 401s.
    res = areal("train", "--alloc", "fsdp:d1", "--experiment", "keys", "--trial", "t0",
                "--areal-overrides", SCRIPT, check=2, timeout=120)  # fmt: skip
    assert f"{served}: want an API key, and AReaL's trainer sends none" in res.stderr
    assert "--api-key none" in res.stderr


def test_areal_overrides_with_co_launched_keyed_servers_says_what_to_do(tmp_path):
    co = areal("train", "--alloc", "hf:d1+fsdp:d1", "--model", str(tmp_path),
               "--areal-overrides", SCRIPT, check=2)  # fmt: skip
    assert "AReaL's trainer sends no API key" in co.stderr and "--api-key none" in co.stderr
