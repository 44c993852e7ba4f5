"""The example jobs a newcomer tries the doctor on (templates/examples), run as the manual
says: `areal train --detach -- -m areal_cli.templates.examples.NAME`, then the doctor names
what is wrong; the minimal worker script and the GRPO example from an installed wheel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest

from tests.helpers import REPO, areal, wait_for

EXAMPLES = "areal_cli.templates.examples"


def _verdict(job: str, registry) -> str | None:
    res = areal("doctor", "hang", "--job", job, "--registry", str(registry), "--json",
                timeout=120)  # fmt: skip
    if res.returncode != 0:
        return None
    return json.loads(res.stdout)["verdict"]["kind"]


@pytest.mark.parametrize(
    "name, kind",
    [("hang", "mismatched_collective"), ("straggler", "straggler"),
     ("wrong_group", "wrong_group")],
)  # fmt: skip
def test_an_example_job_in_the_background_is_named_by_doctor_hang(name, kind, areal_env):
    _, reg = areal_env
    job = f"examples/{name}"
    res = areal("train", "--alloc", "fsdp:d2", "--servers", "none", "--detach",
                "--experiment", "examples", "--trial", name, "--", "-m", f"{EXAMPLES}.{name}",
                check=0, timeout=120)  # fmt: skip
    assert f"started {job}" in res.stdout and f"areal doctor hang --job {job}" in res.stdout
    try:
        # Until the ranks sit where the example puts them (torch's import takes a while).
        wait_for(lambda: _verdict(job, reg) == kind, 240, f"no {kind} verdict", interval=1)
        res = areal("doctor", "hang", "--job", job, "--registry", str(reg), check=0,
                    timeout=120)  # fmt: skip
        assert f"verdict: {kind}" in res.stdout
        assert f"{name}.py" in res.stdout  # the odd rank's frame is the example's own line
    finally:
        areal("stop", job, check=0, timeout=60)


def test_the_diverge_example_is_named_by_doctor_diverge(areal_env):
    job = "examples/diverge"
    areal("train", "--alloc", "fsdp:d2", "--servers", "none", "--detach", "--experiment",
          "examples", "--trial", "diverge", "--", "-m", f"{EXAMPLES}.diverge",
          check=0, timeout=120)  # fmt: skip
    try:

        def named():
            res = areal("doctor", "diverge", "--job", job, "--json", timeout=120)
            if res.returncode not in (0, 1) or not res.stdout.strip():
                return None
            return res if "weight" in res.stdout else None

        res = wait_for(named, 240, "doctor diverge never named the weight", interval=1)
        data = json.loads(res.stdout)
        assert "weight" in json.dumps(data) and res.returncode == 1, res.stdout
    finally:
        areal("stop", job, check=0, timeout=60)


def test_worker_min_samples_from_an_hf_server_after_aligning_it(areal_env, tmp_path):
    from areal_cli.modelgen import create_tiny_model

    tiny = create_tiny_model(tmp_path / "tiny", seed=0)
    areal("serve", "--backend", "hf", "--model", str(tiny), "--detach", check=0, timeout=240)
    try:
        # A generous wait: a loaded host answers /health late.
        res = areal("train", "--alloc", "fsdp:d2", "--wait-servers", "300", "--", "-m",
                    f"{EXAMPLES}.worker_min", check=0, timeout=700)  # fmt: skip
    finally:
        areal("stop", "default/trial0", check=0, timeout=60)
    out = res.stdout + res.stderr
    for rank in (0, 1):
        assert out.count(f"rank {rank}: '") == 4, out  # four prompts, two samples each
    assert "Unclosed client session" not in out and "Traceback" not in out


def test_grpo_example_runs_from_an_installed_wheel_without_a_yaml(areal_env, tmp_path):
    """`-- -m areal_cli.templates.grpo.train`: the example ships in the wheel and its defaults
    need no YAML. The wheel is installed into a folder of its own, ahead of the checkout."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "whl"), str(REPO)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (whl,) = (tmp_path / "whl").glob("areal_cli-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    for example in ("hang", "straggler", "wrong_group", "diverge", "worker_min"):
        assert f"areal_cli/templates/examples/{example}.py" in names
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
         str(whl)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    env = {"PYTHONPATH": str(site)}
    where = subprocess.run(
        [sys.executable, "-c", "import areal_cli.templates.grpo.train as m; print(m.__file__)"],
        env={**os.environ, **env}, capture_output=True, text=True, check=True, cwd=tmp_path,
    ).stdout.strip()  # fmt: skip
    assert where.startswith(str(site)), where
    from areal_cli.modelgen import create_tiny_model

    tiny = create_tiny_model(tmp_path / "tiny", seed=0)
    areal("serve", "--backend", "hf", "--model", str(tiny), "--detach", check=0, timeout=240)
    try:
        res = areal("train", "--alloc", "fsdp:d2", "--wait-servers", "300", "--", "-m",
                    "areal_cli.templates.grpo.train", "steps=2", env=env, cwd=tmp_path,
                    check=0, timeout=900)  # fmt: skip
    finally:
        areal("stop", "default/trial0", check=0, timeout=60)
    assert "training finished with exit code 0" in res.stderr
    assert "GRPO" in res.stdout + res.stderr
