"""Job YAML as a hostile or careless user writes it: whatever the file holds, `areal serve
--config FILE` and `areal train --config FILE` end with one message and exit 2, never a
traceback. Run through the CLI's own entry point (its error handling is what is tested)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_cli.cli import main
from areal_cli.commands._common import yaml_keys

# Keys that would make the command go on to real work if they happened to be valid.
_SKIP = {"model", "scheduler", "script", "servers", "registry"}
SERVE_KEYS = sorted(k for k in yaml_keys("serve") if k not in _SKIP)
NUMERIC = sorted(
    k
    for k, kind in yaml_keys("serve").items()
    if kind in ("int", "posint", "port", "float", "posfloat", "nonneg") and k not in _SKIP
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
containers = st.one_of(
    st.lists(values, max_size=4), st.dictionaries(st.text(max_size=8), values, max_size=4)
)


def run(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    return exc.value.code, err


def _write(data: bytes) -> Path:
    f = tempfile.NamedTemporaryFile("wb", suffix=".yaml", delete=False)
    with f:
        f.write(data)
    return Path(f.name)


def _check(path: Path, capsys, command: str = "serve") -> str:
    argv = [command, "--config", str(path), "--dry-run"]
    if command == "train":
        argv.append("train.py")
    try:
        code, err = run(argv, capsys)
    finally:
        path.unlink()
    assert code == 2, err
    assert err.startswith("error: "), err
    assert "Traceback (most recent call last)" not in err  # the value itself may say "Traceback"
    return err


FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(doc=st.dictionaries(st.sampled_from(SERVE_KEYS), values, min_size=1, max_size=5))
def test_any_values_under_known_keys(doc, capsys):
    """Whatever the values: a message naming the file (a bad value), or the next usage error
    (--model is required): exit 2 either way."""
    text = yaml.safe_dump(doc, allow_unicode=True)
    _check(_write(text.encode()), capsys)


@FUZZ
@given(key=st.sampled_from(NUMERIC), value=containers)
def test_a_list_or_mapping_where_a_number_belongs_names_the_key(key, value, capsys):
    text = yaml.safe_dump({key: value})
    err = _check(_write(text.encode()), capsys)
    assert f": {key} is " in err, err


@FUZZ
@given(key=st.sampled_from(NUMERIC), depth=st.integers(1001, 20000))
def test_deep_nesting_names_the_key(key, depth, capsys):
    text = f"experiment: e\n{key}: " + "[" * depth + "]" * depth + "\n"
    err = _check(_write(text.encode()), capsys)
    assert "too deeply" in err and repr(key) in err, err


@FUZZ
@given(data=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_arbitrary_bytes(data, capsys):
    _check(_write(data), capsys)


def test_non_finite_and_huge_numbers_are_named(capsys):
    for value in ("nan", ".inf", "-1", "1" * 500, "[1]", "{a: 1}", "!!binary aGk=", "2020-01-01"):
        err = _check(_write(f"health_timeout: {value}\n".encode()), capsys)
        assert "health_timeout is" in err, (value, err)


def test_anchors_that_reference_themselves_stay_short(capsys):
    err = _check(_write(b"health_timeout: &a [*a, *a]\n"), capsys)
    assert "health_timeout is" in err and len(err) < 400, err


def test_train_reads_the_same_way(capsys):
    err = _check(_write(b"health_timeout: [1]\n"), capsys, command="train")
    assert "health_timeout is [1]" in err
    assert yaml_keys("train")["health_timeout"] == "posfloat"
