"""The tables both parsers read: the plain forms (read without typer) and the typer commands built
from the same option tables agree on every flag, default, bound and value; a group's help lists
one-liners that match its commands' own help."""

from __future__ import annotations

import importlib

import pytest

from areal_cli import cli
from areal_cli._app import _load
from areal_cli.commands import alloc, doctor, doctor_hang, listing, parse


def _command(*path: str):
    cmd = _load(path[0])
    for name in path[1:]:
        cmd = cmd.commands[name]
    return cmd


def test_every_plain_form_names_a_module_with_its_table():
    for words, (name, _) in cli.FAST.items():
        module = importlib.import_module(f"areal_cli.commands.{name}")
        assert module.OPTIONS and callable(module.plain)
        assert _command(*words).name == words[-1]


@pytest.mark.parametrize(
    "path, table",
    [
        (("ps",), listing.OPTIONS),
        (("alloc",), alloc.OPTIONS),
        (("doctor", "hang"), doctor_hang.OPTIONS),
    ],
)
def test_each_option_of_a_table_is_the_typer_commands_option(path, table):
    params = {p.name: p for p in _command(*path).params}
    for opt in table:
        p = params[opt.key]
        assert tuple(p.opts) + tuple(p.secondary_opts) == opt.flags, opt.key
        assert p.multiple == opt.many
        if not opt.many:
            assert p.default == opt.default, opt.key
        if opt.help:
            assert p.help == opt.help
        assert getattr(p.type, "min", None) == opt.lo and getattr(p.type, "max", None) == opt.hi


HANG_ARGS = [
    [],
    ["-p", "3", "--pid=4", "-n", "2", "--interval", "0", "--json", "--native", "--out", "d"],
    ["--job", "e/t", "--samples", "100", "--timeout", "0.5", "--locals", "--home", "h"],
    ["--registry", "/tmp/reg", "--interval=2.5", "-j", "x/y"],
]


def _typer_values(path: tuple[str, ...], args: list[str]) -> dict:
    cmd = _command(*path)
    with cmd.make_context(path[-1], list(args)) as ctx:
        values = dict(ctx.params)
    return {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in values.items()}


@pytest.mark.parametrize("args", HANG_ARGS)
def test_doctor_hangs_plain_form_reads_what_typer_reads(args, monkeypatch, tmp_path):
    monkeypatch.setenv("AREAL_REGISTRY", str(tmp_path))  # --registry's callback selects it
    plain = parse(doctor_hang.OPTIONS, args)
    typed = _typer_values(("doctor", "hang"), args)
    assert plain is not None
    for key, value in plain.items():
        want = typed[key] if key != "pid" else typed[key] or []
        assert (str(value) if key == "out_dir" and value else value) == (
            str(want) if key == "out_dir" and want else want
        ), key


@pytest.mark.parametrize(
    "path, args, positional",
    [
        (("ps",), ["--all", "--json"], ()),
        (("ps",), [], ()),
        (("alloc",), ["fsdp:d2", "--json"], ("text",)),
        (("alloc",), ["--json", "sglang:d2+fsdp:d4"], ("text",)),
    ],
)
def test_ps_and_allocs_plain_forms_read_what_typer_reads(path, args, positional):
    module = listing if path == ("ps",) else alloc
    plain = parse(module.OPTIONS, args, positional)
    typed = _typer_values(path, args)
    assert plain == {k: typed[k] for k in plain}


@pytest.mark.parametrize(
    "args", [["--samples", "0"], ["--timeout", "nan"], ["-n5"], ["--out", ""], ["--json", "x"]]
)
def test_what_the_plain_form_refuses_typer_refuses_too(args):
    """Refusals go to typer for its message: each of these is one there too (exit 2)."""
    assert parse(doctor_hang.OPTIONS, args) is None
    if args == ["-n5"]:
        assert _typer_values(("doctor", "hang"), args)["samples"] == 5  # click's short form
        return
    with pytest.raises(Exception) as e:
        _typer_values(("doctor", "hang"), args)
    assert getattr(e.value, "exit_code", None) == 2


def test_doctors_one_liners_match_each_commands_own_help():
    """`areal doctor --help` lists the table's lines without importing the commands."""
    from rich.text import Text

    for name, (_, line) in doctor.COMMANDS.items():
        command = _command("doctor", name)
        assert (
            Text.from_markup(line).plain == Text.from_markup(cli.first_line(command.help)).plain
        ), name
