"""`areal doctor allreduce` pieces that need no processes: sizes, the standalone script."""

from __future__ import annotations

import ast

import pytest

from areal_cli.diagnose import allreduce
from areal_cli.errors import UsageError


def test_sizes_double_from_min_to_max():
    assert allreduce.parse_sizes("1K:8K") == [1024, 2048, 4096, 8192]
    assert allreduce.parse_sizes("1K:256M")[-1] == 256 << 20
    assert len(allreduce.parse_sizes("1K:256M")) == 19
    assert allreduce.parse_sizes("4M") == [4 << 20]
    assert allreduce.parse_size("2KiB") == 2048 and allreduce.parse_size("3MB") == 3 << 20


@pytest.mark.parametrize("bad", ["", "abc", "8K:1K", "0", "-1K:2K", "1K:x"])
def test_bad_sizes_are_usage_errors(bad):
    with pytest.raises(UsageError):
        allreduce.parse_sizes(bad)


def test_the_repro_script_is_standalone():
    tree = ast.parse(allreduce.script_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    import sys

    third_party = {r for r in roots if r not in sys.stdlib_module_names and r != "__future__"}
    assert third_party == {"torch"}
    text = allreduce.script_text()
    assert allreduce.FORCE_HANG_ENV in text and allreduce.RESULTS_ENV in text
