"""The GRPO example's checkpoint keys and its metrics file after a resume (no processes)."""

from __future__ import annotations

import json

import pytest

grpo = pytest.importorskip("areal_cli.templates.grpo.train")


def test_checkpoint_keys_have_defaults_that_save_and_resume():
    cfg = grpo.load_config([])
    assert cfg.save_every == 10 and cfg.keep == 2 and cfg.resume is True
    assert cfg.checkpoint_dir is None
    cfg = grpo.load_config(["save_every=0", "resume=false", "keep=5", "checkpoint_dir=/x"])
    assert (cfg.save_every, cfg.resume, cfg.keep, cfg.checkpoint_dir) == (0, False, 5, "/x")


@pytest.mark.parametrize(
    "item, message",
    [
        ("save_every=-1", "save_every must be an integer >= 0, not -1"),
        ("save_every=2.5", "save_every must be an integer >= 0, not 2.5"),
        ("keep=0", "keep must be an integer >= 1, not 0"),
        ("keep=true", "keep must be an integer >= 1, not True"),
        ("resume=maybe", "resume must be true or false, not 'maybe'"),
    ],
)
def test_a_bad_checkpoint_key_is_one_line_and_exit_2(item, message, capsys):
    with pytest.raises(SystemExit) as e:
        grpo.load_config([item])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == f"error: {message}\n"


def _rows(path):
    return [json.loads(x)["step"] for x in path.read_text().splitlines()]


def test_metrics_go_on_from_the_resumed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    # The run that died had gone three steps past its checkpoint at step 4.
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(7)))
    grpo.Report(tmp_path, resumed_at=4)
    assert _rows(path) == [0, 1, 2, 3]
    grpo.Report(tmp_path)  # starting over: a fresh curve
    assert path.read_text() == ""
