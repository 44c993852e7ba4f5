"""`--areal-overrides` for AReaL's own trainer (areal_cli.areal_entry): what the installed
AReaL version understands, what its interpreter lacks, and the pairings that fail inside
AReaL. The interpreter is a real one asked with a real subprocess; the AReaL it finds is a
distribution's metadata on its path, as pip would leave it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from areal_cli import areal_entry
from areal_cli.errors import UsageError

PIN_LINE = "sglang[tracing]==0.5.10.post1; sys_platform == 'linux' and extra == 'sglang'"


def dist(site: Path, name: str, version: str, *requires: str) -> None:
    d = site / f"{name}-{version}.dist-info"
    d.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    (d / "METADATA").write_text("\n".join(lines) + "\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setenv("PYTHONPATH", str(site))
    return site


def test_version_1_gets_each_engines_backend_in_add_or_override_form():
    got = areal_entry.overrides("1.0.4", "hf", 2, "fsdp:d2", "e", "t", ["x.y=z"])
    # An hf server speaks SGLang's protocol; every key in hydra's add-or-override form.
    assert got[:2] == ["++rollout.backend=sglang:d2", "++actor.backend=fsdp:d2"]
    assert "++experiment_name=e" in got and "++trial_name=t" in got
    assert "++rollout.experiment_name=e" in got and "++actor.trial_name=t" in got
    assert got[-1] == "++x.y=z"
    assert all(a.startswith("++") for a in got)
    assert not [a for a in got if a.startswith("++allocation_mode")]


def test_version_0_5_gets_allocation_mode():
    got = areal_entry.overrides("0.5.3", "vllm", 1, "vllm:d1+fsdp:d4t2", "e", "t", [])
    assert got[0] == "++allocation_mode=vllm:d1+fsdp:d4t2"
    assert not [a for a in got if "backend=" in a or a.startswith("++actor.")]


def test_probe_reads_areal_its_pin_sglang_and_the_config(site, tmp_path):
    dist(site, "areal", "1.0.4", "torch<2.11", PIN_LINE)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("actor:\n  weight_update_mode: disk\n")
    t = areal_entry.probe(sys.executable, ["--config", str(cfg)])
    assert (t.version, t.sglang_pin, t.sglang, t.weight_update_mode) == (
        "1.0.4", "0.5.10.post1", None, "disk",
    )  # fmt: skip
    # The user's own override on the command line wins over the yaml, in any hydra form.
    t = areal_entry.probe(sys.executable, [f"--config={cfg}", "++actor.weight_update_mode=xccl"])
    assert t.weight_update_mode == "xccl"
    with pytest.raises(UsageError) as e:
        areal_entry.check_metadata(t, "hf")
    assert "needs sglang's package metadata" in e.value.message
    assert "pip install --no-deps 'sglang==0.5.10.post1'" in e.value.hint
    areal_entry.check_metadata(t, "vllm")  # a vLLM server needs no sglang
    dist(site, "sglang", "0.5.10.post1")
    areal_entry.check_metadata(areal_entry.probe(sys.executable, []), "sglang")


def test_no_areal_and_a_bad_config_are_usage_errors(site, tmp_path):
    with pytest.raises(UsageError) as e:
        areal_entry.probe(sys.executable, [])
    assert "AReaL is not installed in" in e.value.message and "--python" in e.value.hint
    dist(site, "areal", "1.0.4")
    with pytest.raises(UsageError, match="no such file|No such file"):
        areal_entry.probe(sys.executable, ["--config", str(tmp_path / "missing.yaml")])
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor: [unclosed\n")
    with pytest.raises(UsageError, match="is not YAML"):
        areal_entry.probe(sys.executable, ["--config", str(bad)])
    with pytest.raises(UsageError, match="cannot run it"):
        areal_entry.probe(str(tmp_path / "no-python"), [])


def test_xccl_against_another_sglang_than_areal_pins_is_refused():
    t = areal_entry.Target("py", "1.0.4", "0.5.10.post1", "0.5.10.post1", "xccl")
    with pytest.raises(UsageError) as e:
        areal_entry.check_pairing(t, "sglang", {"h:1": "0.5.23", "h:2": "0.5.10.post1"})
    msg = e.value.message
    assert (
        "AReaL 1.0.4" in msg and "SGLang 0.5.10.post1" in msg and "h:1 serves SGLang 0.5.23" in msg
    )
    assert "h:2" not in msg
    assert "actor.weight_update_mode=disk" in e.value.hint and "0.5.10.post1" in e.value.hint
    # Disk sync, the pinned version, an unknown version, and the hf server all pass.
    areal_entry.check_pairing(areal_entry.Target("py", "1.0.4", None, "0.5.10.post1", "disk"),
                              "sglang", {"h:1": "0.5.23"})  # fmt: skip
    areal_entry.check_pairing(t, "sglang", {"h:2": "0.5.10.post1", "h:3": None})
    areal_entry.check_pairing(t, "hf", {"h:1": "0.5.23"})
