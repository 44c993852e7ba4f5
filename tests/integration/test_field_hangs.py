"""Hangs reproduced from public reports (tests/scenarios/field_*.py), each run under `areal train`
as a real gloo job and judged by `areal doctor hang --json`.

Each scenario names its report (`Source: URL` in its docstring) and what the doctor must say in
a machine-readable line: `# expect: {"nproc": N, "kind": KIND, "odd_ranks": [...]}`. Most are
plain torchrun scripts without areal's worker runtime, so the doctor has their stacks only (no
flight recorder); those that need the recorder connect to the runtime. Every rank touches
SCENARIO_DIR/ready-<rank> once it sits where the report says it hangs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from areal_cli import procs
from areal_cli.diagnose import hang_rules
from tests.helpers import AREAL, REPO, areal

FIELD = sorted((REPO / "tests" / "scenarios").glob("field_*.py"))
EXPECT = re.compile(r"^# expect: (\{.*\})$", re.M)
SOURCE = re.compile(r"Source: (https://github\.com/[\w.-]+/[\w.-]+/(issues|pull)/\d+)")


def expectation(script: Path) -> dict:
    text = script.read_text()
    found = EXPECT.search(text)
    assert found, f"{script.name}: no '# expect: {{...}}' line"
    return json.loads(found.group(1))


def test_the_corpus_holds_a_dozen_reports_each_with_its_source_and_answer():
    assert len(FIELD) >= 12
    sources = set()
    for script in FIELD:
        exp = expectation(script)
        assert exp["kind"] in hang_rules.KINDS and exp["kind"] in hang_rules.HANGS, script.name
        assert exp["nproc"] >= 2 and all(0 <= r < exp["nproc"] for r in exp["odd_ranks"])
        src = SOURCE.search(script.read_text())
        assert src, f"{script.name}: no Source: URL"
        sources.add(src.group(1))
    assert len(sources) == len(FIELD), "one report per scenario"


@pytest.mark.parametrize("script", FIELD, ids=lambda p: p.stem.removeprefix("field_"))
def test_a_hang_from_the_field_is_judged_right(script: Path, tmp_path):
    exp = expectation(script)
    n, trial = exp["nproc"], script.stem.replace("_", "-")
    workdir = tmp_path / "scenario"
    workdir.mkdir()
    env = {
        **os.environ,
        "SCENARIO_DIR": str(workdir),
        "SCENARIO_LIFETIME": "150",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    log_path = tmp_path / "train.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [AREAL, "train", "--alloc", f"fsdp:d{n}", "--servers", "none", "--trial", trial,
             str(script)],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(
                    f"areal train exited {proc.returncode}\n{log_path.read_text()}"
                )
            return all((workdir / f"ready-{r}").exists() for r in range(n))

        assert procs.wait_until(ready, 150, cap=0.1), log_path.read_text()[-3000:]
        res = areal("doctor", "hang", "--job", f"default/{trial}", "--json",
                    "--samples", "2", "--interval", "0.3", check=0, timeout=90)  # fmt: skip
        assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout}\n{res.stderr}"
        v = json.loads(res.stdout)["verdict"]
        got = {"kind": v["kind"], "odd_ranks": v["odd_ranks"]}
        assert got == {"kind": exp["kind"], "odd_ranks": exp["odd_ranks"]}, (
            f"{v['summary']}\n{v['evidence']}"
        )
        assert v["hang"] and v["advice"]["action"] in hang_rules.ADVICE
    finally:
        # The hung ranks have nothing to save: a short grace before they are killed.
        areal("stop", f"default/{trial}", "--timeout", "3", timeout=60)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
