"""`areal doctor env`: rendered presets work in a real shell, `-- CMD` runs CMD under the
preset and returns its exit code, warnings name variables from the user's environment."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from areal_cli.diagnose import presets

AREAL = str(Path(sys.executable).parent / "areal")


def areal(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [AREAL, "doctor", "env", *args], capture_output=True, text=True, timeout=60, env=env
    )


def clean_env(**extra: str) -> dict:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "TORCH", "CUDA_LAUNCH"))
    }
    env.update(extra)
    return env


def test_bash_output_evaluates_to_the_preset(tmp_path):
    dump = "import json, os; print(json.dumps({k: os.environ[k] for k in json.loads(os.environ['WANT'])}))"
    for name in presets.preset_names():
        want = presets.preset_env(name)
        script = f'eval "$({AREAL} doctor env --preset {name})" && {sys.executable} -c "{dump}"'
        res = subprocess.run(
            ["bash", "-c", script],
            capture_output=True,
            text=True,
            timeout=60,
            env=clean_env(WANT=json.dumps(sorted(want))),
        )
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout) == want, name


@pytest.mark.skipif(shutil.which("fish") is None, reason="fish is not installed")
def test_fish_output_evaluates_to_the_preset():
    res = subprocess.run(
        [
            "fish",
            "-c",
            f"{AREAL} doctor env --preset nccl-bisect --shell fish | source; echo $NCCL_IB_DISABLE",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.stdout.strip() == "1"


def test_json_shell_and_list():
    res = areal("--preset", "hang", "--shell", "json", env=clean_env())
    assert res.returncode == 0
    assert json.loads(res.stdout) == presets.preset_env("hang")
    res = areal("--list", "--shell", "json")
    assert [p["name"] for p in json.loads(res.stdout)] == presets.preset_names()
    res = areal("--preset", "nccl-bisect", "--explain")
    assert (
        res.returncode == 0 and "NCCL_SHM_DISABLE" in res.stdout and "shared-memory" in res.stdout
    )


def test_run_command_returns_its_exit_code_and_sees_the_vars(tmp_path):
    out = tmp_path / "seen.json"
    code = (
        "import json, os, sys; "
        f"json.dump({{k: os.environ.get(k) for k in ('NCCL_DEBUG', 'NCCL_P2P_DISABLE', 'KEEP')}}, open({str(out)!r}, 'w')); "
        "sys.exit(7)"
    )
    res = areal(
        "--preset", "nccl-bisect", "--", sys.executable, "-c", code, env=clean_env(KEEP="yes")
    )
    assert res.returncode == 7, res.stderr
    assert json.loads(out.read_text()) == {
        "NCCL_DEBUG": "INFO",
        "NCCL_P2P_DISABLE": "1",
        "KEEP": "yes",
    }
    res = areal("--preset", "hang", "--", sys.executable, "-c", "pass", env=clean_env())
    assert res.returncode == 0


def test_run_creates_the_dump_directory(tmp_path):
    # The flight recorder does not create its directory; the preset run does.
    res = areal(
        "--preset",
        "hang",
        "--",
        sys.executable,
        "-c",
        "import os; assert os.path.isdir(os.path.dirname(os.environ['TORCH_FR_DUMP_TEMP_FILE']))",
        env=clean_env(),
    )
    assert res.returncode == 0, res.stderr


def test_warnings_name_variables_from_the_environment():
    res = areal("--preset", "perf", env=clean_env(CUDA_LAUNCH_BLOCKING="1"))
    assert res.returncode == 0
    assert "CUDA_LAUNCH_BLOCKING in a perf run" in res.stderr
    assert "from your environment" in res.stderr
    assert "CUDA_LAUNCH_BLOCKING" not in res.stdout  # stdout stays eval-able
    res = areal("--preset", "compile", env=clean_env(TORCH_NCCL_DUMP_ON_TIMEOUT="1"))
    assert "without a flight recorder buffer" in res.stderr
    res = areal("--preset", "hang", env=clean_env(NCCL_SHM_DISABLE="1"))
    assert "NCCL_SHM_DISABLE=1 left on" in res.stderr


def test_bad_input_exits_2():
    res = areal("--preset", "nope")
    assert res.returncode == 2 and "valid presets" in res.stderr and "Traceback" not in res.stderr
    res = areal()
    assert res.returncode == 2 and "--preset is required" in res.stderr
    res = areal("--preset", "hang", "--shell", "zsh")
    assert res.returncode == 2
    res = areal("--preset", "hang", "--", "definitely-not-a-command-xyz")
    assert res.returncode == 2 and "command not found" in res.stderr
