"""Seconds read from the environment (settings.registry_ttl, settings.slurm_timeout): a value
out of range or not a number is one usage error naming the variable, its value and the range."""

from __future__ import annotations

import pytest

from areal_cli import settings
from areal_cli.errors import UsageError

CASES = [
    ("AREAL_REGISTRY_TTL", settings.registry_ttl, 30.0, "1..3600"),
    ("AREAL_SLURM_TIMEOUT", settings.slurm_timeout, 30.0, "0.5..600"),
]


@pytest.mark.parametrize("name, read, default, span", CASES)
def test_unset_is_the_default_and_a_number_in_range_is_taken(
    monkeypatch, name, read, default, span
):
    monkeypatch.delenv(name, raising=False)
    assert read() == default
    monkeypatch.setenv(name, "2.5")
    assert read() == 2.5


@pytest.mark.parametrize("name, read, default, span", CASES)
@pytest.mark.parametrize("raw", ["x", "", "nan", "0.1", "9999", "-5"])
def test_a_bad_value_is_a_usage_error_naming_it(monkeypatch, name, read, default, span, raw):
    monkeypatch.setenv(name, raw)
    with pytest.raises(UsageError) as got:
        read()
    assert got.value.message == f"{name}={raw!r} is not a number of seconds in {span}"
    assert got.value.exit_code == 2
