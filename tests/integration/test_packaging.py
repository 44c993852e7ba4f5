"""The built wheel ships commands/ and templates/ inside areal_cli, and the CLI starts light."""

import subprocess
import sys
import zipfile

from tests.helpers import REPO, areal


def test_wheel_holds_commands_and_templates(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(REPO)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (whl,) = tmp_path.glob("areal_cli-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert "areal_cli/commands/serve.py" in names
    assert "areal_cli/commands/train.py" in names
    assert any(n.startswith("areal_cli/templates/grpo/") for n in names)
    assert "areal_cli/templates/env_presets.yaml" in names
    assert any(n.endswith("entry_points.txt") for n in names)
    # Every package of the source tree made it in (the package list is explicit).
    for init in (REPO / "src").rglob("__init__.py"):
        assert str(init.relative_to(REPO / "src")) in names, init


def test_help_does_not_import_torch():
    code = (
        "import sys; from areal_cli import cli; "
        "heavy = [m for m in ('torch', 'transformers', 'aiohttp') if m in sys.modules]; "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    out = areal("--help", check=0).stdout
    for cmd in ("serve", "train", "ps", "logs", "stop", "doctor", "alloc", "init-model"):
        assert cmd in out
    # Defaults in help text survive rich markup (square brackets would be eaten).
    serve_help = areal("serve", "--help", env={"COLUMNS": "200"}, check=0).stdout
    assert "(default auto)" in serve_help and "areal serve --backend hf" in serve_help
