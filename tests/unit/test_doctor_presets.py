"""Debug env presets: one YAML, every preset renders for every shell, warnings catch
combinations that do nothing or harm, also when they come from the user's environment."""

from __future__ import annotations

import json
import shlex

import pytest

from areal_cli.diagnose import presets
from areal_cli.errors import UsageError

SPEC_VARS = {
    "TORCH_DISTRIBUTED_DEBUG",
    "NCCL_DEBUG",
    "NCCL_DEBUG_SUBSYS",
    "NCCL_DEBUG_FILE",
    "TORCH_LOGS",
    "TORCHDYNAMO_VERBOSE",
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "TORCH_FR_DUMP_TEMP_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_BLOCKING_WAIT",
    "TORCH_SHOW_CPP_STACKTRACES",
    "CUDA_LAUNCH_BLOCKING",
    "NCCL_P2P_DISABLE",
    "NCCL_SHM_DISABLE",
    "NCCL_IB_DISABLE",
}


def test_names_and_api():
    assert presets.preset_names() == ["compile", "crash", "hang", "nccl", "nccl-bisect", "perf"]
    env = presets.preset_env("hang")
    assert env["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert all(isinstance(v, str) for v in env.values())


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(UsageError) as e:
        presets.preset_env("hangs")
    assert "nccl-bisect" in e.value.hint and "perf" in e.value.hint
    assert e.value.exit_code == 2


def test_spec_variables_are_covered_and_each_has_a_meaning():
    seen = set()
    for name in presets.preset_names():
        for v in presets.get_preset(name).vars:
            assert v.meaning, f"{name}.{v.name} has no meaning"
            assert "\n" not in v.meaning
            seen.add(v.name)
    assert SPEC_VARS <= seen


def test_transport_switches_only_in_nccl_bisect_and_launch_blocking_only_in_crash():
    for name in presets.preset_names():
        env = presets.preset_env(name)
        has_switch = any(v in env for v in presets.TRANSPORT_SWITCHES)
        assert has_switch == (name == "nccl-bisect"), name
        assert ("CUDA_LAUNCH_BLOCKING" in env) == (name == "crash"), name
    compile_env = presets.preset_env("compile")
    assert compile_env["TORCH_LOGS"] == "+dynamo,recompiles"
    assert compile_env["TORCHDYNAMO_VERBOSE"] == "1"


@pytest.mark.parametrize("name", ["compile", "crash", "hang", "nccl", "nccl-bisect", "perf"])
@pytest.mark.parametrize("shell", presets.SHELLS)
def test_every_preset_renders_for_every_shell(name, shell):
    text = presets.render(name, shell)
    env = presets.preset_env(name)
    if shell == "json":
        assert json.loads(text) == env
        return
    parsed = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or line.startswith("mkdir "):
            continue
        if shell == "bash":
            assert line.startswith("export ")
            k, _, v = line[len("export ") :].partition("=")
            parsed[k] = shlex.split(v)[0] if v else ""
        elif shell == "fish":
            assert line.startswith("set -gx ")
            _, _, k, v = line.split(" ", 3)
            parsed[k] = v[1:-1].replace("\\'", "'").replace("\\\\", "\\")
        else:
            k, _, v = line.partition("=")
            parsed[k] = v[1:-1] if v.startswith('"') else v
    assert parsed == env


def test_bash_render_creates_the_dump_directories():
    text = presets.render("hang", "bash")
    assert "mkdir -p /tmp/areal-debug" in text


def test_dump_on_timeout_without_buffer_warns_when_it_comes_from_the_environment():
    found = presets.check("compile", {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"})
    assert any("without a flight recorder buffer" in w.message for w in found)
    assert all(w.source == "environment" for w in found)
    assert not presets.check("hang", {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"})


def test_transport_switches_left_on_warn_outside_bisect():
    found = presets.check("hang", {"NCCL_IB_DISABLE": "1", "NCCL_P2P_DISABLE": "1"})
    assert len(found) == 1
    assert "NCCL_P2P_DISABLE=1" in found[0].message and "unset" in found[0].fix
    assert not presets.check("nccl-bisect", {"NCCL_IB_DISABLE": "1"})


def test_debug_switches_in_a_perf_run_warn():
    found = presets.check("perf", {"CUDA_LAUNCH_BLOCKING": "1", "TORCH_NCCL_BLOCKING_WAIT": "1"})
    messages = " ".join(w.message for w in found)
    assert "CUDA_LAUNCH_BLOCKING" in messages and "TORCH_NCCL_BLOCKING_WAIT" in messages
    assert presets.check("perf", {}) == []


def test_clean_presets_have_no_warnings_in_a_clean_environment():
    for name in presets.preset_names():
        assert presets.check(name, {}) == [], name
