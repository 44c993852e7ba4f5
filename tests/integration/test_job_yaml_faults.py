"""The three job YAMLs that used to end in a traceback or a long wait, through the real
`areal` console script: each is one message naming what is wrong, exit 2, in well under a
second of the command's own time."""

from __future__ import annotations

import sys
import time

import pytest

from tests.helpers import areal


def _serve(path) -> tuple[object, float]:
    t0 = time.monotonic()
    res = areal("serve", "--config", str(path), "--dry-run", timeout=60)
    return res, time.monotonic() - t0


@pytest.mark.parametrize("value", ["[1]", "{a: 1}"])
def test_a_container_where_a_number_belongs(tmp_path, value):
    path = tmp_path / "job.yaml"
    path.write_text(f"experiment: e\nhealth_timeout: {value}\n")
    res, took = _serve(path)
    assert res.returncode == 2, res.stderr
    assert "health_timeout is" in res.stderr and "not a number > 0" in res.stderr
    assert "Traceback" not in res.stderr and "TypeError" not in res.stderr
    print(f"health_timeout: {value}: exit 2 in {took:.2f}s", file=sys.stderr)


def test_5000_deep_nesting(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("experiment: e\nhealth_timeout: " + "[" * 5000 + "]" * 5000 + "\n")
    res, took = _serve(path)
    assert res.returncode == 2, res.stderr
    assert "too deeply" in res.stderr and "'health_timeout' (line 2)" in res.stderr
    assert "Traceback" not in res.stderr and "RecursionError" not in res.stderr
    print(f"5000-deep nesting: exit 2 in {took:.2f}s", file=sys.stderr)


def test_a_50_mb_file_is_refused_before_parsing(tmp_path):
    path = tmp_path / "job.yaml"
    with open(path, "w") as f:
        f.write("experiment: e\n")
        for _ in range(50):
            f.write("# " + "x" * (1 << 20) + "\n")
    res, took = _serve(path)
    assert res.returncode == 2, res.stderr
    assert "larger than 256 KiB" in res.stderr
    assert "Traceback" not in res.stderr
    assert took < 10, took
    print(f"50 MB file: exit 2 in {took:.2f}s", file=sys.stderr)
