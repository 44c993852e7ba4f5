"""`areal alloc` through the installed console script: table, --json shape, exit 2 on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The console script installed next to the interpreter running the tests.
AREAL = Path(sys.executable).parent / "areal"


def areal(*args: str) -> subprocess.CompletedProcess:
    assert AREAL.exists(), f"no `areal` next to {sys.executable}: install the package there"
    env = {**os.environ, "COLUMNS": "120", "NO_COLOR": "1", "TERM": "dumb"}
    return subprocess.run([str(AREAL), *args], capture_output=True, text=True, timeout=60, env=env)


def test_table_lists_components_and_total():
    r = areal("alloc", "sglang[rollout]:d2t2+fsdp[actor]:d4|megatron[critic]:d2t2e2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    header = next(line for line in lines if "backend" in line).split()
    assert header == [
        "name", "backend", "role", "d", "t", "p", "c", "e", "world", "per", "rep", "colocated"
    ]  # fmt: skip
    rows = {line.split()[0]: line.split() for line in lines if len(line.split()) == 11}
    assert rows["rollout"] == [
        "rollout",
        "sglang",
        "inference",
        "2",
        "2",
        "1",
        "1",
        "1",
        "4",
        "2",
        "-",
    ]
    assert rows["actor"] == ["actor", "fsdp", "train", "4", "1", "1", "1", "1", "4", "1", "critic"]
    assert rows["critic"] == [
        "critic",
        "megatron",
        "train",
        "2",
        "2",
        "1",
        "1",
        "2",
        "4",
        "2",
        "actor",
    ]
    assert "experts (ffn)" not in r.stdout
    assert "total world size: 8 GPUs" in r.stdout
    assert r.stderr == ""


def test_table_shows_moe_expert_dims():
    r = areal("alloc", "sglang:d2+megatron:(attn:d2t2|ffn:e2)")
    assert r.returncode == 0, r.stderr
    assert "megatron experts (ffn): d2 t1 p1 e2" in r.stdout
    assert "total world size: 6 GPUs" in r.stdout


def test_areal_seed_string_with_explicit_ones_is_accepted():
    # allocation_mode=fsdp:d2p1t1 from AReaL issue #752: p1 is no pipeline parallelism.
    r = areal("alloc", "fsdp:d2p1t1", "--json")
    assert r.returncode == 0, r.stderr
    (comp,) = json.loads(r.stdout)["components"]
    assert (comp["backend"], comp["d"], comp["t"], comp["p"], comp["world_size"]) == (
        "fsdp",
        2,
        1,
        1,
        2,
    )


def test_json_shape():
    r = areal("alloc", "sglang:d4t2+fsdp:d8", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["text"] == "sglang:d4t2+fsdp:d8"
    assert data["world_size"] == 16
    inf, train = data["components"]
    expected_inf = {
        "name": None,
        "backend": "sglang",
        "role": "inference",
        "d": 4,
        "t": 2,
        "p": 1,
        "c": 1,
        "e": 1,
        "world_size": 8,
        "colocate_with": None,
    }
    assert {k: inf[k] for k in expected_inf} == expected_inf
    assert (train["backend"], train["role"], train["d"], train["world_size"]) == (
        "fsdp",
        "train",
        8,
        8,
    )


def test_json_colocated_and_moe():
    r = areal("alloc", "megatron[a]:d2p2t2e2|sglang[r]:d8", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    meg, srv = data["components"]
    assert (meg["d"], meg["t"], meg["p"], meg["c"], meg["e"]) == (2, 2, 2, 1, 2)
    assert srv["colocate_with"] == "a" and "ffn" not in srv and "ffn" not in meg
    assert data["world_size"] == 8
    r = areal("alloc", "sglang:d8+megatron:(attn:d2p2t2|ffn:t2e2)", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    moe = data["components"][1]
    assert moe["ffn"] == {"d": 1, "t": 2, "p": 2, "e": 2}
    assert (moe["d"], moe["t"], moe["p"], moe["c"], moe["e"]) == (2, 2, 2, 1, 2)
    assert data["world_size"] == 16


@pytest.mark.parametrize("extra", [(), ("--json",)])
def test_bad_string_exits_2_with_caret_and_hint(extra):
    r = areal("alloc", "sglang:d4+fsdp:d4p2", *extra)
    assert r.returncode == 2
    assert r.stdout == ""
    err = r.stderr.splitlines()
    assert err[0] == "error: bad allocation: fsdp does not take pipeline parallelism (p2)"
    assert err[1] == "  sglang:d4+fsdp:d4p2"
    assert err[2] == "  " + " " * 17 + "^"
    assert err[3].startswith("hint: fsdp takes d, t and c (p1 is fine)")
    assert "Traceback" not in r.stderr


def test_legacy_string_prints_modern_equivalent():
    r = areal("alloc", "sglang.d4p1t1+d4p1t1")
    assert r.returncode == 2
    assert "hint: write sglang:d4t1+fsdp:d4" in r.stderr
    # Brackets in strings survive rich rendering (no markup swallowed).
    r = areal("alloc", "sglang[a]:d4+fsdp[a]:d4")
    assert r.returncode == 2 and "  sglang[a]:d4+fsdp[a]:d4" in r.stderr


def test_help_has_examples():
    r = areal("alloc", "--help")
    assert r.returncode == 0
    assert "areal alloc sglang:d4t2+fsdp:d8" in r.stdout
    assert "sglang[rollout]:d2+fsdp[actor]:d4|fsdp[critic]:d4" in r.stdout
