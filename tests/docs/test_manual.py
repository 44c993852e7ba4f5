"""Every code block of README.md and docs/*.md run as a reader would, one test per block (id
PAGE:LINE), and per page an `end` that fails if anything the page started survives. A page
is a walk: its blocks run in order in one sandbox (tests/docs/walk.py; the conventions are in
docs/tests.md). The longest pages have modules of their own (test_manual_*.py)."""

from __future__ import annotations

import pytest

from tests.docs.walk import OWN_MODULE, items, run_block

pytestmark = pytest.mark.docs


@pytest.mark.parametrize("block", items(skip=OWN_MODULE))
def test_block(block, walks, request):
    run_block(block, walks, request)
