"""A doctor asked about a local training job right after `areal train --detach` (which returns
once the job is placed, before torchrun has spawned its ranks) waits for the ranks instead of
calling the job dead; a serving job, which has none, is refused at once."""

from __future__ import annotations

import json

from tests.helpers import areal

WAITS = """
import time

def waits_here():
    time.sleep(600)

waits_here()
"""


def test_hang_right_after_detach_finds_the_ranks(tmp_path):
    script = tmp_path / "waits.py"
    script.write_text(WAITS)
    areal("train", "--alloc", "fsdp:d2", "--servers", "none", "--detach", str(script), check=0)
    try:
        res = areal("doctor", "hang", "--job", "default/trial0", "--interval", "0.2", "--json",
                    timeout=120)  # fmt: skip
        assert res.returncode == 0, res.stderr
        data = json.loads(res.stdout)
        assert len(data["ranks"]) == 2
        assert all(r["frame"]["function"] == "waits_here" for r in data["ranks"])
    finally:
        areal("stop", "default/trial0", timeout=60)


def test_a_serving_job_is_not_waited_for(tmp_path):
    # No ranks will ever come: the refusal is at once, as before.
    from tests.helpers import fake_serve_args

    model = tmp_path / "model"
    model.mkdir()
    areal(*fake_serve_args(model, "--alloc", "hf:d1", "--detach"), check=0)
    try:
        res = areal("doctor", "hang", "--job", "default/trial0", timeout=20)
        assert res.returncode == 2
        assert "no live rank processes" in res.stderr
    finally:
        areal("stop", "default/trial0", timeout=60)
