"""One schema for `areal serve` and `areal train`: the options declared in the command are the
job YAML's keys, their defaults are the job's, and a flag beats the file, the file the
default. Through the CLI's own entry point, on dry runs that plan and start nothing."""

from __future__ import annotations

import json

import pytest

from areal_cli.cli import main
from areal_cli.commands import _common


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    return exc.value.code, out, err


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("AREAL_REGISTRY", str(tmp_path / "registry"))


def _server_argv(out: str) -> list[str]:
    (proc,) = json.loads(out)["processes"]
    return proc["argv"]


def _after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("name", ["serve", "train"])
def test_the_yaml_keys_are_the_commands_options(name):
    from areal_cli._app import _load

    options = {p.name for p in _load(name).params if p.param_type_name == "option"}
    keys = set(_common.yaml_keys(name))
    assert keys == (options - _common.NOT_IN_YAML) | {"scheduler_opts"} | (
        {"extra_args"} if name == "serve" else set()
    )
    # Kinds come from the options' own types and ranges.
    assert _common.yaml_keys(name)["health_timeout"] == "posfloat"
    assert _common.yaml_keys(name)["gpus_per_node"] == "posint"
    assert _common.yaml_keys(name)["slurm_arg"] == "list"


def test_flag_beats_the_file_and_the_file_the_default(tmp_path, capsys):
    base = ["serve", "--model", str(tmp_path), "--backend", "hf", "--dry-run", "--json"]
    code, out, err = run(base, capsys)
    assert code in (0, None), err
    argv = _server_argv(out)
    assert _after(argv, "--seed") == "1" and _after(argv, "--host") == "127.0.0.1"

    job = tmp_path / "job.yaml"
    job.write_text("seed: 7\nhost: 127.0.0.2\n")
    code, out, err = run([*base, "--config", str(job)], capsys)
    assert code in (0, None), err
    argv = _server_argv(out)
    assert _after(argv, "--seed") == "7" and _after(argv, "--host") == "127.0.0.2"

    code, out, err = run([*base, "--config", str(job), "--seed", "9"], capsys)
    assert code in (0, None), err
    argv = _server_argv(out)
    assert _after(argv, "--seed") == "9" and _after(argv, "--host") == "127.0.0.2"


def test_a_value_out_of_the_options_range_names_the_file_and_key(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("health_timeout: 0.05\n")
    code, _, err = run(["serve", "--config", str(job), "--dry-run"], capsys)
    assert code == 2, err
    assert err.startswith(f"error: config file {job}: health_timeout is 0.05"), err


def test_train_takes_its_watchdog_defaults_from_its_options(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("")
    job = tmp_path / "job.yaml"
    job.write_text("watchdog_action: fail\nmax_restarts: 2\n")
    argv = ["train", "--alloc", "fsdp:d1", "--servers", "none", "--dry-run", "--json"]
    code, out, err = run([*argv, "--config", str(job), str(script)], capsys)
    assert code in (0, None), err
    plan = json.loads(out)
    assert plan["watchdog_action"] == "fail" and plan["max_restarts"] == 2, plan
    code, out, err = run([*argv, str(script)], capsys)
    assert code in (0, None), err
    plan = json.loads(out)
    assert plan["watchdog_action"] == "observe" and plan["max_restarts"] == 0, plan
