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
        (["ps", "--json"], {"listing"}),
        (["ps", "--all", "--json"], {"listing"}),
        (["alloc", "sglang:d2+fsdp:d4", "--json"], {"alloc"}),
        (["alloc", "--json", "sglang:d2+fsdp:d4"], {"alloc"}),
        (["--version"], set()),
    ],
)
def test_fast_paths_import_nothing_heavy(tmp_path, args, modules):
    """Scripts call these in loops: no typer either (about 50 ms, twice an interpreter)."""
    res, mods = loaded(tmp_path, *args)
    assert res.returncode == 0, res.stderr
    assert not roots(mods) & (HEAVY | {"typer", "click"}), sorted(roots(mods) & HEAVY)
    assert commands_loaded(mods) == modules
    # Machine output needs no rich; ps with no jobs probes nothing.
    assert "rich" not in roots(mods)
    assert not [m for m in mods if m.rsplit(".", 1)[-1] == "supervisor"]
    if args[0] == "ps":
        assert json.loads(res.stdout) == []
        assert "http.client" not in mods
        assert "psutil" not in roots(mods)


def test_ps_of_a_used_home_reads_its_records_without_dataclasses_or_typing(tmp_path):
    """`dataclasses` (with inspect, ast, dis) and `typing` were a third of what `areal ps
    --json` cost beyond a bare interpreter: the records and statuses it reads are plain."""
    from pathlib import Path

    from areal_cli import schedulers
    from areal_cli.schedulers.local import records

    home = Path(os.environ["AREAL_HOME"])
    schedulers.note_used(home, "local")
    records.write(home, records.JobRecord(
        experiment="e", trial="t", kind="serve", state="stopped", marker="m", supervisor_pid=1,
        supervisor_create_time=None, host="h", started=1.0, log_dir="/l", registry="/r",
        processes=[records.ProcessRecord("server", 0, 2, ["x"], "/l/s", addr="127.0.0.1:9")],
    ))  # fmt: skip
    res, mods = loaded(tmp_path, "ps", "--all", "--json")
    assert res.returncode == 0, res.stderr
    (job,) = json.loads(res.stdout)
    assert (job["name"], job["state"]) == ("e/t", "stopped")
    assert job["servers"][0]["addr"] == "127.0.0.1:9"
    assert not mods & {"dataclasses", "typing", "inspect"}, sorted(mods & {"dataclasses", "typing"})


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


def test_the_plain_forms_answer_as_typer_does(tmp_path):
    """The same output and exit code with and without typer; a bad allocation is exit 2."""
    env = {**os.environ, "COLUMNS": "80", "AREAL_HOME": str(tmp_path)}
    for args in (["--version"], ["alloc", "fsdp:d2t2", "--json"], ["alloc", "bad:x", "--json"]):
        plain = subprocess.run([sys.executable, "-m", "areal_cli", *args], capture_output=True,
                               text=True, env=env, timeout=60)  # fmt: skip
        # --debug is a typer option: it takes the typer path for the same command.
        typed = subprocess.run([sys.executable, "-m", "areal_cli", "--debug", *args],
                               capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
        assert (plain.returncode, plain.stdout) == (typed.returncode, typed.stdout), args
    assert plain.returncode == 2 and "unknown backend 'bad'" in plain.stderr
    assert "Traceback" not in plain.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["ps", "--json", "--json"],
        ["ps", "--help"],
        ["ps", "-h"],
        ["ps", "--home", "/tmp"],
        ["alloc", "--json"],
        ["alloc", "a", "b"],
        ["alloc", "--help", "--json"],
        ["--version", "ps"],
    ],
)
def test_what_the_plain_forms_do_not_take_goes_to_typer(args):
    assert cli._fast(args) is None


def test_doctor_hang_with_plain_flags_skips_typer(tmp_path):
    """Run beside a hung job, often in a loop: its start-up is most of a 16-rank dump."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        args = ["doctor", "hang", "--pid", str(sleeper.pid), "--json", "--samples", "1"]
        res, mods = loaded(tmp_path, *args)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["verdict"]["kind"] == "blocked_outside_collective"
        assert "typer" not in roots(mods) and "rich" not in roots(mods)
        assert not roots(mods) & HEAVY
        # A bad value goes through typer for its usual message and exit code 2.
        res, mods = loaded(tmp_path, "doctor", "hang", "--pid", str(sleeper.pid), "-n", "0")
        assert res.returncode == 2
        assert "0 is not in the range 1<=x<=100" in res.stderr
        assert "typer" in roots(mods)
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["--pid"],
        ["--pid", "x"],
        ["--pid", "-3"],
        ["--samples", "101"],
        ["--interval=-1"],
        ["--timeout", "0.1"],
        ["--json=1"],
        ["-p=3"],
        ["--bogus"],
        ["extra"],
    ],
)
def test_doctor_hang_plain_parser_leaves_the_rest_to_typer(args):
    from areal_cli.commands import doctor_hang, parse

    assert parse(doctor_hang.OPTIONS, args) is None


def test_doctor_hang_plain_parser_reads_what_typer_reads():
    from areal_cli.commands import doctor_hang, parse

    opts = parse(
        doctor_hang.OPTIONS,
        ["-p", "3", "--pid=4", "-n", "2", "--interval", "0", "--json", "--native", "--out", "d"],
    )
    assert opts["pid"] == [3, 4] and opts["samples"] == 2 and opts["interval"] == 0.0
    assert opts["json_out"] and opts["native"] and not opts["show_locals"]
    assert str(opts["out_dir"]) == "d" and opts["timeout"] == 10.0 and opts["job"] is None


# What `doctor hang` may have imported when its first py-spy starts: the rest (the verdict's
# rules, the flight recorder's reader, rendering) is imported while the dumps run.
RECORD_AT_FIRST_DUMP = """
import json, os, sys
from areal_cli.diagnose import stacks
start = stacks.start_many
def first(*a, **k):
    if not os.path.exists(os.environ["MODULES_AT_DUMP"]):
        json.dump(sorted(sys.modules), open(os.environ["MODULES_AT_DUMP"], "w"))
    return start(*a, **k)
stacks.start_many = first
sys.argv = ["areal", *sys.argv[1:]]
from areal_cli.cli import main
main()
"""

BEFORE_DUMP_AREAL = {
    "areal_cli",
    "areal_cli.cli",
    "areal_cli.errors",
    "areal_cli.commands",
    "areal_cli.commands.doctor_hang",
    "areal_cli.diagnose",
    "areal_cli.diagnose.hang",
    "areal_cli.diagnose.stacks",
    "areal_cli.diagnose.targets",
}


def test_doctor_hang_starts_dumping_before_it_imports_the_judges(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    at_dump = tmp_path / "at_dump.json"
    try:
        env = {**os.environ, "MODULES_AT_DUMP": str(at_dump)}
        args = ["doctor", "hang", "--pid", str(sleeper.pid), "--json", "--samples", "1"]
        res = subprocess.run(
            [sys.executable, "-c", RECORD_AT_FIRST_DUMP, *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
    finally:
        sleeper.kill()
        sleeper.wait()
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["verdict"]["kind"] == "blocked_outside_collective"
    mods = set(json.loads(at_dump.read_text()))
    ours = {m for m in mods if m.split(".")[0] == "areal_cli"}
    assert ours <= BEFORE_DUMP_AREAL, sorted(ours - BEFORE_DUMP_AREAL)
    stdlib = set(sys.stdlib_module_names)
    others = roots(mods) - stdlib - {"areal_cli", "__main__", "_distutils_hack"}
    others = {m for m in others if not m.startswith("__editable__")}
    assert not others, sorted(others)  # psutil neither: targets reads /proc itself
    # py-spy runs through posix_spawn; typing comes with rendering, after the dumps; the
    # permission check, the dumps' types and what judges them (dataclasses, with inspect)
    # are imported while the first dumps run.
    assert not {"subprocess", "typing", "dataclasses", "inspect"} & mods


def test_rank_env_names_the_job_marker():
    from areal_cli import procs
    from areal_cli.diagnose import targets

    assert procs.MARKER_ENV in targets.RANK_ENV
