"""`areal train --areal-overrides` refuses, before any rank starts, what would stop AReaL's
own trainer: no AReaL in --python, and no sglang metadata beside it (AReaL's trainer reads
sglang's version before it talks to any SGLang-protocol server). The AReaL found is a
distribution's metadata on the interpreter's path, as pip leaves it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, areal, fake_serve_args

SCRIPT = str(REPO / "tests" / "fixtures" / "scripts" / "record_env.py")


@pytest.fixture
def served(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    out = json.loads(areal(*fake_serve_args(model, "--api-key", "none", "--detach", "--json"),
                           check=0).stdout)  # fmt: skip
    yield out["servers"][0]["addr"]
    areal("stop", "default/trial0", check=0)


def fake_areal(site: Path, *dists: tuple[str, str, str]) -> dict[str, str]:
    for name, version, requires in dists:
        d = site / f"{name}-{version}.dist-info"
        d.mkdir(parents=True)
        req = f"Requires-Dist: {requires}\n" if requires else ""
        d.joinpath("METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\n"
                                          f"Version: {version}\n{req}")  # fmt: skip
    return {"PYTHONPATH": str(site)}


def test_what_areals_trainer_lacks_is_refused_before_any_rank(served, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("actor:\n  weight_update_mode: disk\n")
    args = ("train", "--alloc", "fsdp:d1", "--python", sys.executable, "--areal-overrides",
            SCRIPT, "--config", str(cfg))  # fmt: skip
    res = areal(*args, check=2, timeout=120)
    assert f"AReaL is not installed in {sys.executable}" in res.stderr
    pin = "sglang==0.5.10.post1; extra == 'sglang'"
    env = fake_areal(tmp_path / "site", ("areal", "1.0.4", pin))
    res = areal(*args, env=env, check=2, timeout=120)
    assert "AReaL 1.0.4" in res.stderr and "needs sglang's package metadata" in res.stderr
    assert "pip install --no-deps 'sglang==0.5.10.post1'" in res.stderr
    assert "Traceback" not in res.stderr and "started torchrun" not in res.stderr
    res = areal(*args[:-2], "--config", str(tmp_path / "gone.yaml"), env=env, check=2)
    assert "gone.yaml: No such file or directory" in res.stderr


def test_doctor_check_reports_areal_in_the_trainers_python(tmp_path):
    def rows(env=None) -> dict[str, dict]:
        res = areal("doctor", "check", "--python", sys.executable, "--json", env=env,
                    timeout=120)  # fmt: skip
        return {r["name"]: r for r in json.loads(res.stdout)["rows"]}

    got = rows()["areal (trainer)"]
    assert (
        got["status"] == "fail" and f"AReaL is not installed in {sys.executable}" in got["detail"]
    )
    site = tmp_path / "site"
    env = fake_areal(site, ("areal", "1.0.4", "sglang[tracing]==0.5.10.post1; extra == 'sglang'"))
    got = rows(env)
    assert got["areal (trainer)"]["status"] == "pass"
    assert got["areal (trainer)"]["detail"] == f"AReaL 1.0.4 in {sys.executable}"
    meta = got["sglang metadata"]
    assert meta["status"] == "fail" and "SGLangConfig.build_args" in meta["detail"]
    assert "pip install --no-deps 'sglang==0.5.10.post1'" in meta["fix"]
    fake_areal(site, ("sglang", "0.5.10.post1", ""))
    meta = rows(env)["sglang metadata"]
    assert meta["status"] == "pass" and meta["detail"] == "0.5.10.post1 (AReaL pins 0.5.10.post1)"
