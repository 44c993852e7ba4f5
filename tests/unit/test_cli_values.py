"""Every float and path option of every command, as the parser builds them: nan, inf and the
empty path are refused (exit 2 through click's usage error), whatever command adds them."""

from __future__ import annotations

import pytest

from areal_cli._app import _load
from areal_cli.cli import COMMANDS


def _params(kind_names: tuple[str, ...]):
    out = []

    def walk(path: str, cmd) -> None:
        if hasattr(cmd, "commands"):
            for name in list(cmd.commands):
                walk(f"{path} {name}", cmd.commands[name])
            return
        for p in cmd.params:
            if str(getattr(p.type, "name", "")).split()[:1] in [[k] for k in kind_names]:
                out.append((path, p))

    for name in COMMANDS:
        walk(name, _load(name))
    return out


FLOATS = _params(("float",))
PATHS = _params(("path", "file", "directory"))


def test_the_walk_finds_the_options_it_guards():
    # The names this relies on: a rename in typer would make the guard (and this test) vacuous.
    assert ("doctor profile", "duration") in {(c, p.name) for c, p in FLOATS}
    assert ("doctor profile", "out_dir") in {(c, p.name) for c, p in PATHS}
    assert len(FLOATS) >= 8 and len(PATHS) >= 10


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "Infinity"])
def test_no_float_option_takes_nan_or_inf(value):
    for cmd, p in FLOATS:
        with pytest.raises(Exception, match="not a finite number|not in the range") as e:
            p.type.convert(value, p, None)
        assert getattr(e.value, "exit_code", None) == 2, (cmd, p.name)
        # A finite value in range still passes.
        assert p.type.convert(str(p.default if p.default is not None else 5), p, None) >= 0


@pytest.mark.parametrize("value", ["", " "])
def test_no_path_option_takes_the_empty_path(value):
    for cmd, p in PATHS:
        with pytest.raises(Exception, match="an empty path") as e:
            p.type.convert(value, p, None)
        assert getattr(e.value, "exit_code", None) == 2, (cmd, p.name)
