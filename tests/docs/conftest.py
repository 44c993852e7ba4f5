"""Fixtures of the manual's walks (tests/docs/walk.py): one set per test module."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.docs.walk import AREAL, Walk


@pytest.fixture(scope="module")
def walks():
    """page → its walk, made at the page's first block; closed at the page's `end` item, or
    here for a page whose `end` did not run (a selection of blocks)."""
    state: dict[str, Walk] = {}
    yield state
    for walk in state.values():
        walk.close()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """The model the manual's pages call ./demo-model, made once per module."""
    path = tmp_path_factory.mktemp("docs-model") / "demo-model"
    subprocess.run([AREAL, "init-model", str(path)], check=True, capture_output=True)
    return path
