"""What `areal` imports at start-up: only the invoked command's module, nothing heavy.

Each case runs the real entry point in a fresh interpreter that writes `sys.modules` to a
file at exit, so the check sees exactly what one call loaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from areal_cli import cli

HEAVY = {"torch", "transformers", "aiohttp", "pydantic", "pygments"}

RECORD = """
import atexit, json, os, sys
atexit.register(lambda: json.dump(sorted(sys.modules), open(os.environ["MODULES_OUT"], "w")))
sys.argv = ["areal", *sys.argv[1:]]
from areal_cli.cli import main
main()
"""


def loaded(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    out = tmp_path / "modules.json"
    env = {**os.environ, "MODULES_OUT": str(out), "COLUMNS": "80"}
    res = subprocess.run(
        [sys.executable, "-c", RECORD, *args], capture_output=True, text=True, env=env, timeout=60
    )
    return res, set(json.loads(out.read_text()))


def roots(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


def commands_loaded(modules: set[str]) -> set[str]:
    return {m.rsplit(".", 1)[1] for m in modules if m.startswith("areal_cli.commands.")}


@pytest.mark.parametrize(
    "args, modules",
    [
        (["ps", "--json"], {"jobs", "_common"}),
        (["alloc", "sglang:d2+fsdp:d4", "--json"], {"alloc"}),
        (["--version"], set()),
    ],
)
def test_fast_paths_import_nothing_heavy(tmp_path, args, modules):
    res, mods = loaded(tmp_path, *args)
    assert res.returncode == 0, res.stderr
    assert not roots(mods) & HEAVY, sorted(roots(mods) & HEAVY)
    assert commands_loaded(mods) == modules
    # Machine output needs no rich; ps with no jobs probes nothing.
    assert "rich" not in roots(mods)
    assert not [m for m in mods if m.rsplit(".", 1)[-1] == "supervisor"]
    if args[0] == "ps":
        assert json.loads(res.stdout) == []
        assert "http.client" not in mods
        assert "psutil" not in roots(mods)


@pytest.mark.parametrize("args", [["--help"], ["doctor", "hang", "--help"], ["train"]])
def test_help_skips_markdown_and_pygments(tmp_path, args):
    res, mods = loaded(tmp_path, *args)
    assert res.returncode == (2 if args == ["train"] else 0), res.stderr
    assert not roots(mods) & HEAVY, sorted(roots(mods) & HEAVY)
    assert "rich.markdown" not in mods
    assert "typer.rich_utils" not in mods


def test_top_level_help_lists_every_command_without_importing_them(tmp_path):
    res, mods = loaded(tmp_path, "--help")
    assert commands_loaded(mods) == set()
    lines = res.stdout.splitlines()
    for name in cli.COMMANDS:
        assert any(line.split()[:1] == [name] for line in lines), (name, res.stdout)


def test_one_liners_match_each_commands_own_help():
    """The table `areal --help` reads must say what each command's help says first."""
    from rich.text import Text

    for name, (_, line) in cli.COMMANDS.items():
        command = cli._load(name)
        assert (
            Text.from_markup(line).plain == Text.from_markup(cli.first_line(command.help)).plain
        ), name


def test_unknown_command_is_exit_2_with_a_suggestion(tmp_path):
    res, _ = loaded(tmp_path, "trian")
    assert res.returncode == 2
    assert "No such command 'trian'" in res.stderr
    assert "'train'" in res.stderr
