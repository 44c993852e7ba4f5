"""Tiny random-weight models: transformers loads them offline, the tokenizer round-trips text,
the bytes are a function of the seed, and `areal init-model` refuses a non-empty directory."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest

from areal_cli.cli import main as areal_main
from areal_cli.errors import UsageError
from areal_cli.modelgen import (
    EOS_TOKEN_ID,
    check_target_dir,
    create_tiny_model,
    model_summary,
    padded_vocab_size,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def _digest(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_transformers_loads_model_and_tokenizer(tiny: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(tiny, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.config.model_type == "qwen2"
    assert model.config.vocab_size == padded_vocab_size() and padded_vocab_size() % 8 == 0
    tok = AutoTokenizer.from_pretrained(tiny)
    assert tok.eos_token_id == tok.pad_token_id == EOS_TOKEN_ID
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [257, 258]

    ids = tok("Hello, world!\n", return_tensors="pt").input_ids
    assert ids[0].tolist() == list(b"Hello, world!\n")
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], padded_vocab_size())
    assert torch.isfinite(logits).all()
    # Next-token distributions are far from flat, so greedy decoding has clear winners.
    assert logits[0, -1].std().item() > 1.0


def test_tokenizer_round_trips_arbitrary_text(tiny: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    samples = [
        "".join(chr(i) for i in range(1, 128)),
        "  leading and  double  spaces ",
        "tabs\tand\r\nnewlines\n\n",
        "unicode: héllo wörld ✓ 中文",
        "<|im_start|>user\nhi<|im_end|>",
    ]
    for text in samples:
        assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n"


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path):
    a = create_tiny_model(tmp_path / "a", seed=3)
    started = time.perf_counter()
    b = create_tiny_model(tmp_path / "b", seed=3)
    took = time.perf_counter() - started
    c = create_tiny_model(tmp_path / "c", seed=4)
    assert _digest(a) == _digest(b) != _digest(c)
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()
    assert took < 2.0


def test_default_heads_are_32_wide(tiny: Path):
    # vLLM's CPU attention takes head sizes 32..512 (v1/attention/backends/cpu_attn.py:69-70);
    # 16 passed /health and crashed the first request. tests/engines/ serves this model.
    config = json.loads((tiny / "config.json").read_text())
    assert config["head_dim"] == 32 and config["hidden_size"] == 64
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (2, 1)


def test_summary_counts_parameters_like_torch(tmp_path: Path):
    from transformers import AutoModelForCausalLM

    path = create_tiny_model(tmp_path / "m", hidden_size=32, num_layers=3)
    summary = model_summary(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert summary["params"] == sum(p.numel() for p in model.parameters())
    assert (summary["hidden_size"], summary["num_layers"]) == (32, 3)
    assert model.config.num_hidden_layers == 3


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"hidden_size": 30}, "not a multiple of 32"),
        ({"hidden_size": 30, "num_heads": 4, "num_kv_heads": 2}, "divisible by num_heads"),
        ({"num_heads": 4, "num_kv_heads": 3}, "num_kv_heads"),
        ({"hidden_size": 12, "num_heads": 4, "num_kv_heads": 2}, "odd"),
        ({"num_layers": 0}, "at least 1"),
    ],
)
def test_bad_shapes_are_usage_errors(tmp_path: Path, kw: dict, needle: str):
    with pytest.raises(UsageError, match=needle):
        create_tiny_model(tmp_path / "m", **kw)
    assert not (tmp_path / "m").exists()


def test_check_target_dir(tmp_path: Path):
    check_target_dir(tmp_path / "new", force=False)
    check_target_dir(tmp_path, force=False)  # exists but empty
    (tmp_path / "x").write_text("x")
    with pytest.raises(UsageError, match="not empty"):
        check_target_dir(tmp_path, force=False)
    check_target_dir(tmp_path, force=True)
    with pytest.raises(UsageError, match="not a directory"):
        check_target_dir(tmp_path / "x", force=True)


def _run_cli(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exit_info:
        areal_main(argv)
    return exit_info.value.code


def test_init_model_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    target = tmp_path / "tiny"
    assert _run_cli(["init-model", str(target), "--json", "--seed", "2"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["path"] == str(target.resolve())
    assert summary["vocab_size"] == padded_vocab_size() and summary["params"] > 0
    assert summary["seed"] == 2 and "model.safetensors" in summary["files"]
    first = _digest(target)

    assert _run_cli(["init-model", str(target)]) == 2
    captured = capsys.readouterr()
    assert "not empty" in captured.err and "--force" in captured.err
    assert "Traceback" not in captured.err
    assert _digest(target) == first

    # A stale shard from another checkpoint must not survive --force.
    (target / "model-00002-of-00002.safetensors").write_bytes(b"stale")
    assert _run_cli(["init-model", str(target), "--force", "--hidden-size", "32"]) == 0
    out = capsys.readouterr().out
    assert "wrote" in out and "hidden 32" in out
    assert not (target / "model-00002-of-00002.safetensors").exists()
    assert _digest(target) != first

    assert _run_cli(["init-model", str(tmp_path / "odd"), "--hidden-size", "30"]) == 2
    assert "not a multiple of 32" in capsys.readouterr().err
