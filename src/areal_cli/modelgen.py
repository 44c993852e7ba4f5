"""Tiny random-weight causal LMs that transformers loads offline: the model every CPU path uses.

`create_tiny_model(path)` writes a Qwen2-style checkpoint (config.json, generation_config.json,
model.safetensors) and a byte-level tokenizer (tokenizer.json, tokenizer_config.json) built
locally with the `tokenizers` library. Nothing is downloaded, and transformers is not imported:
the weights are drawn from one seeded generator in a fixed order, so the same seed gives the
same bytes on every machine and transformers version.

The tokenizer has one token per byte (ids 0-255, in the GPT-2 byte-to-unicode alphabet, so any
UTF-8 text round-trips) and three specials: <|endoftext|> (eos and pad), <|im_start|>,
<|im_end|>. The embedding is rounded up to a multiple of 8 rows, as real checkpoints pad
their vocabulary; the extra ids decode to nothing.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from areal_cli.errors import UsageError

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
NUM_BYTE_TOKENS = 256
EOS_TOKEN = "<|endoftext|>"
EOS_TOKEN_ID = NUM_BYTE_TOKENS  # first special after the bytes
VOCAB_ALIGN = 8
LM_HEAD_STD = 0.3

# ChatML, as Qwen2 models use it, so `apply_chat_template` works on the tiny model too.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Files this module writes (and the ones `--force` clears so a stale shard never mixes in).
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
_STALE_WEIGHT_GLOBS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin")


# Heads of 32: the smallest head size vLLM's CPU attention takes
# (v1/attention/backends/cpu_attn.py:69-70, 32..512), and one SGLang, vLLM and hf all serve.
HEAD_DIM = 32


def padded_vocab_size() -> int:
    n = NUM_BYTE_TOKENS + len(SPECIAL_TOKENS)
    return (n + VOCAB_ALIGN - 1) // VOCAB_ALIGN * VOCAB_ALIGN


def create_tiny_model(
    path: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    intermediate_size: int = 128,
    seed: int = 0,
    max_position_embeddings: int = 512,
) -> Path:
    """Write a tiny Qwen2-style causal LM with random weights to `path` and return it.

    Existing model files in `path` are overwritten; use `check_target_dir` first where a
    non-empty directory should be refused. Unless given, the heads are of HEAD_DIM (so the
    hidden size must be a multiple of it) and two share a KV head.
    """
    if num_heads is None:
        if hidden_size < HEAD_DIM or hidden_size % HEAD_DIM:
            raise UsageError(
                f"hidden_size {hidden_size} is not a multiple of {HEAD_DIM}",
                hint=f"heads are {HEAD_DIM} wide (the smallest vLLM's CPU attention takes): "
                "use 32, 64, 96, ...",
            )
        num_heads = hidden_size // HEAD_DIM
    if num_kv_heads is None:
        num_kv_heads = max(1, num_heads // 2) if num_heads % 2 == 0 else num_heads
    _validate_shape(hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size)
    out = Path(path).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    for pattern in _STALE_WEIGHT_GLOBS:
        for stale in out.glob(pattern):
            stale.unlink()

    config = _config(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
    )
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": EOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": EOS_TOKEN_ID},
    )
    _write_weights(out / "model.safetensors", config, seed)
    _write_tokenizer(out)
    return out


def check_target_dir(path: str | Path, *, force: bool) -> None:
    """Refuse to write into a non-empty directory unless `force` (a file path is always refused)."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise UsageError(f"{p} exists and is not a directory", hint="choose a directory path")
    if p.is_dir() and any(p.iterdir()) and not force:
        raise UsageError(
            f"{p} exists and is not empty",
            hint="pass --force to overwrite the model files in it, or choose a new directory",
        )


def model_summary(path: str | Path) -> dict[str, Any]:
    """What a checkpoint directory holds: sizes from config.json, parameter count from the
    safetensors headers (read without loading any tensor)."""
    p = Path(path).expanduser()
    try:
        config = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {p / 'config.json'}: {e}") from e
    params = 0
    for f in sorted(p.glob("*.safetensors")):
        for name, info in _safetensors_header(f).items():
            if name == "__metadata__":
                continue
            n = 1
            for dim in info["shape"]:
                n *= dim
            params += n
    return {
        "path": str(p.resolve()),
        "model_type": config.get("model_type"),
        "params": params,
        "vocab_size": config.get("vocab_size"),
        "hidden_size": config.get("hidden_size"),
        "num_layers": config.get("num_hidden_layers"),
        "files": sorted(f.name for f in p.iterdir() if f.is_file()),
    }


def _validate_shape(hidden: int, layers: int, heads: int, kv_heads: int, inter: int) -> None:
    for name, value in (
        ("hidden_size", hidden),
        ("num_layers", layers),
        ("num_heads", heads),
        ("num_kv_heads", kv_heads),
        ("intermediate_size", inter),
    ):
        if value < 1:
            raise UsageError(f"{name} must be at least 1, got {value}")
    if hidden % heads:
        raise UsageError(
            f"hidden_size {hidden} is not divisible by num_heads {heads}",
            hint="use a hidden size that is a multiple of the head count (default 4 heads)",
        )
    if heads % kv_heads:
        raise UsageError(f"num_heads {heads} is not divisible by num_kv_heads {kv_heads}")
    if (hidden // heads) % 2:
        raise UsageError(
            f"head dim {hidden // heads} is odd; rotary embeddings need an even head dim",
            hint="use a hidden size that is a multiple of 2 x num_heads",
        )


def _config(
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": padded_vocab_size(),
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "use_cache": True,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": num_layers,
        "attention_dropout": 0.0,
        "bos_token_id": EOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": EOS_TOKEN_ID,
        "torch_dtype": "float32",
    }


def _write_weights(file: Path, config: dict[str, Any], seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    inter = config["intermediate_size"]
    head_dim = config["head_dim"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim
    std = config["initializer_range"]

    def normal(*shape: int, scale: float = std) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": normal(config["vocab_size"], hidden)
    }
    for i in range(config["num_hidden_layers"]):
        pre = f"model.layers.{i}"
        tensors[f"{pre}.input_layernorm.weight"] = torch.ones(hidden)
        tensors[f"{pre}.self_attn.q_proj.weight"] = normal(q_dim, hidden)
        tensors[f"{pre}.self_attn.q_proj.bias"] = normal(q_dim)
        tensors[f"{pre}.self_attn.k_proj.weight"] = normal(kv_dim, hidden)
        tensors[f"{pre}.self_attn.k_proj.bias"] = normal(kv_dim)
        tensors[f"{pre}.self_attn.v_proj.weight"] = normal(kv_dim, hidden)
        tensors[f"{pre}.self_attn.v_proj.bias"] = normal(kv_dim)
        tensors[f"{pre}.self_attn.o_proj.weight"] = normal(hidden, q_dim)
        tensors[f"{pre}.post_attention_layernorm.weight"] = torch.ones(hidden)
        tensors[f"{pre}.mlp.gate_proj.weight"] = normal(inter, hidden)
        tensors[f"{pre}.mlp.up_proj.weight"] = normal(inter, hidden)
        tensors[f"{pre}.mlp.down_proj.weight"] = normal(hidden, inter)
    tensors["model.norm.weight"] = torch.ones(hidden)
    # An untied output head drawn wider than a fresh pretraining init: a tied head would make
    # every token predict itself, and wider logits give next-token distributions clear winners,
    # so greedy decoding is stable under the small numeric differences batching introduces.
    tensors["lm_head.weight"] = normal(config["vocab_size"], hidden, scale=LM_HEAD_STD)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # Order the 256 byte symbols by the byte they stand for, so token id == byte value.
    by_byte = _bytes_to_unicode()
    assert sorted(by_byte.values()) == sorted(alphabet)
    vocab = {by_byte[b]: b for b in range(NUM_BYTE_TOKENS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(str(out / "tokenizer.json"))

    added = {
        str(NUM_BYTE_TOKENS + i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": added,
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "bos_token": None,
            "eos_token": EOS_TOKEN,
            "pad_token": EOS_TOKEN,
            "unk_token": None,
            "model_max_length": 1 << 20,
            "clean_up_tokenization_spaces": False,
            "padding_side": "left",
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(
        out / "special_tokens_map.json",
        {
            "eos_token": EOS_TOKEN,
            "pad_token": EOS_TOKEN,
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        },
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode map (the alphabet of the ByteLevel pre-tokenizer)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _safetensors_header(file: Path) -> dict[str, Any]:
    with file.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def _write_json(file: Path, data: dict[str, Any]) -> None:
    file.write_text(json.dumps(data, indent=2) + "\n")
