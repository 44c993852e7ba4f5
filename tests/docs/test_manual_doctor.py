"""The blocks of docs/doctor.md, as test_manual.py runs the other pages' (a module of its own:
a test worker of its own under `make test-docs`)."""

from __future__ import annotations

import pytest

from tests.docs.walk import items, run_block

pytestmark = pytest.mark.docs


@pytest.mark.parametrize("block", items(only=("docs/doctor.md",)))
def test_block(block, walks, request):
    run_block(block, walks, request)
