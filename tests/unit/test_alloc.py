"""The allocation grammar: valid forms, every rule with the position it reports, and fuzzing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_cli.alloc import (
    INFERENCE_BACKENDS,
    TRAIN_BACKENDS,
    Allocation,
    AllocError,
    Component,
    FfnDims,
    caret,
    parse,
)
from areal_cli.errors import EXIT_USAGE, UsageError


def dims(c: Component) -> tuple[int, int, int, int, int]:
    return (c.d, c.t, c.p, c.c, c.e)


def fails(text: str) -> AllocError:
    with pytest.raises(AllocError) as info:
        parse(text)
    return info.value


# --------------------------------------------------------------------------- valid forms


def test_decoupled_inference_and_train():
    a = parse("sglang:d4t2+fsdp:d8")
    assert isinstance(a, Allocation) and a.text == "sglang:d4t2+fsdp:d8"
    inf, train = a.components
    assert (inf.backend, inf.role, inf.name, dims(inf)) == (
        "sglang",
        "inference",
        None,
        (4, 2, 1, 1, 1),
    )
    assert (inf.world_size, inf.gpus_per_replica, inf.colocate_with) == (8, 2, None)
    assert (train.backend, train.role, dims(train), train.world_size) == (
        "fsdp",
        "train",
        (8, 1, 1, 1, 1),
        8,
    )
    assert a.world_size == 16
    assert a.inference == (inf,) and a.train is train


@pytest.mark.parametrize(
    "text, expected",
    [
        ("fsdp:d2", (2, 1, 1, 1, 1)),
        ("fsdp:t2d2c2", (2, 2, 1, 2, 1)),
        ("vllm:t4", (1, 4, 1, 1, 1)),
        ("hf:d1", (1, 1, 1, 1, 1)),
        ("sglang:d2t2p2", (2, 2, 2, 1, 1)),
        ("megatron:d2t2p2c2e4", (2, 2, 2, 2, 4)),
        ("archon:p4d2", (2, 1, 4, 1, 1)),
        ("sglang:d1024", (1024, 1, 1, 1, 1)),
        # A 1 is fine wherever AReaL's grammar has the letter: fsdp:d2p1t1 is from AReaL #752.
        ("fsdp:d2p1t1", (2, 1, 1, 1, 1)),
        ("fsdp:e1c2p1d2", (2, 1, 1, 2, 1)),
        ("sglang:d2p1t1", (2, 1, 1, 1, 1)),
        ("megatron:c1e1", (1, 1, 1, 1, 1)),
    ],
)
def test_single_dims_any_order_defaults_to_one(text, expected):
    (c,) = parse(text).components
    assert dims(c) == expected


def test_world_size_ignores_e_and_per_replica_by_role():
    (m,) = parse("megatron:d4t2e8").components
    assert (m.world_size, m.gpus_per_replica) == (8, 2)
    (f,) = parse("fsdp:d2t2c2").components
    assert (f.world_size, f.gpus_per_replica) == (8, 4)
    (s,) = parse("sglang:d3t2p2").components
    assert (s.world_size, s.gpus_per_replica) == (12, 4)


def test_inference_only_and_train_only():
    a = parse("vllm:d2t2")
    assert a.train is None and len(a.inference) == 1 and a.world_size == 4
    b = parse("fsdp:d2")
    assert b.inference == () and b.train.backend == "fsdp" and b.world_size == 2


def test_names_and_lookup():
    a = parse("sglang[rollout]:d2+fsdp[_actor_0]:d4")
    assert [c.name for c in a.components] == ["rollout", "_actor_0"]
    assert a.get("_actor_0").backend == "fsdp" and a.get("nope") is None


def test_three_named_components_train_is_first_train():
    a = parse("sglang[r]:d2+fsdp[actor]:d4+megatron[critic]:d2")
    assert a.train.name == "actor"
    assert a.world_size == 8


def test_colocation_counts_group_once_and_points_at_anchor():
    a = parse("sglang[r]:d2+fsdp[a]:d4|fsdp[c]:d4")
    r, actor, critic = a.components
    assert (r.colocate_with, actor.colocate_with, critic.colocate_with) == (None, None, "a")
    assert a.world_size == 2 + 4


def test_colocation_binds_tighter_than_plus():
    a = parse("sglang[r]:d4|fsdp[a]:d2t2+fsdp[b]:d3")
    assert [c.colocate_with for c in a.components] == [None, "r", None]
    assert a.world_size == 4 + 3


def test_colocation_of_three():
    a = parse("sglang[r]:d4|fsdp[a]:d4|fsdp[b]:t2d2")
    assert [c.colocate_with for c in a.components] == [None, "r", "r"]
    assert a.world_size == 4


def test_moe_with_ffn_d_given():
    (m,) = parse("megatron:(attn:d1p2t2c2|ffn:d1p2t1e4)").components
    assert dims(m) == (1, 2, 2, 2, 4)
    assert m.ffn == FfnDims(d=1, t=1, p=2, e=4)
    assert m.world_size == 8


def test_moe_derives_ffn_d_and_p():
    (m,) = parse("archon:(attn:d4t2|ffn:e4)").components
    assert m.ffn == FfnDims(d=2, t=1, p=1, e=4)
    (m,) = parse("megatron:(attn:d2p2t2|ffn:t2e2)").components
    assert m.ffn == FfnDims(d=1, t=2, p=2, e=2)


def test_moe_without_parentheses():
    a = parse("megatron:attn:d4t2|ffn:t2e4+sglang:d4")
    m, s = a.components
    assert m.name is None and m.ffn == FfnDims(d=1, t=2, p=1, e=4)
    assert s.colocate_with is None and a.world_size == 12
    # After the ffn dims, '|' is colocation again (refused here: the group's first is unnamed).
    e = fails("megatron:attn:d2|ffn:e2|fsdp[b]:d2")
    assert "colocated components" in e.message


def test_whitespace_between_tokens_is_ignored():
    spaced = parse("  sglang [ r ] : d4 t 2 +\tfsdp[a]: d 8 |\r\nfsdp [b] :\fd8 ")
    tight = parse("sglang[r]:d4t2+fsdp[a]:d8|fsdp[b]:d8")
    assert spaced.components == tight.components
    spaced = parse("sglang : d4 + megatron :( attn : d8 | ffn : e2 ) ")
    tight = parse("sglang:d4+megatron:(attn:d8|ffn:e2)")
    assert spaced.components == tight.components


def test_to_json_shape():
    a = parse("sglang[r]:d2t2+fsdp[a]:d4|megatron[c]:d2t2e2")
    data = a.to_json()
    assert data["text"] == a.text and data["world_size"] == 8
    keys = {"name", "backend", "role", "d", "t", "p", "c", "e", "world_size", "colocate_with"}
    for comp in data["components"]:
        assert keys <= comp.keys()
    r, fsdp, meg = data["components"]
    assert r == {**r, "name": "r", "backend": "sglang", "role": "inference", "d": 2, "t": 2}
    assert (r["world_size"], r["colocate_with"]) == (4, None)
    assert fsdp["role"] == "train" and "ffn" not in fsdp
    assert meg["colocate_with"] == "a" and meg["e"] == 2 and "ffn" not in meg
    (moe,) = parse("megatron:(attn:d2t2|ffn:e2)").to_json()["components"]
    assert (moe["e"], moe["world_size"]) == (2, 4)
    assert moe["ffn"] == {"d": 2, "t": 1, "p": 1, "e": 2}


def test_components_are_frozen():
    (c,) = parse("fsdp:d2").components
    with pytest.raises(AttributeError):
        c.d = 3


# --------------------------------------------------------------------------- errors

ERRORS = [
    # (text, position, words in the message, words in the hint)
    ("", 0, "empty", "sglang:d4t1"),
    ("   ", 3, "empty", None),
    ("d4t2", 0, "missing backend", "sglang:d4t2 or fsdp:d4t2"),
    ("d4p2", 0, "missing backend", "sglang:d4p2 or megatron:d4p2"),
    ("d4e2", 0, "missing backend", "megatron:d4e2"),
    ("sglang:d4+d4p1t1", 10, "missing backend", "sglang:d4p1t1 or fsdp:d4p1t1"),
    ("d4c2e1", 0, "missing backend", "write fsdp:d4c2e1"),
    ("[actor]:d4", 0, "missing backend", "fsdp[name]"),
    ("sglan:d4", 0, "unknown backend 'sglan'", "did you mean sglang"),
    ("SGLang:d4", 0, "unknown backend", "did you mean sglang"),
    ("torch:d4", 0, "unknown backend", "backends:"),
    ("sglang d4", 7, "expected ':'", "sglang:d4"),
    ("sglang[r]d4", 9, "expected ':'", "sglang[r]:d4"),
    ("sglang:", 7, "expected dimensions", None),
    ("sglang:+fsdp:d2", 7, "expected dimensions", None),
    ("sglang:d", 8, "expected a size after 'd'", None),
    ("sglang:dt2", 8, "expected a size after 'd'", None),
    ("sglang:d0", 8, "positive integer", "d1"),
    ("sglang:d04", 8, "leading zeros", "d4"),
    ("sglang:d99999999", 8, "too large", None),
    ("sglang:d4x2", 9, "unknown dimension 'x'", "d (data)"),
    ("sglang:d4m2", 9, "unknown dimension 'm'", "now 't'"),
    ("sglang:D4", 7, "unknown dimension 'D'", "lowercase"),
    ("fsdp:d2d4", 7, "given twice", None),
    ("megatron:t2d2t2", 13, "given twice", None),
    ("fsdp:d4p2", 7, "fsdp does not take pipeline parallelism (p2)", "p1 is fine"),
    ("fsdp:d4e2", 7, "fsdp does not take expert parallelism (e2)", "megatron"),
    ("fsdp:e2d2p3", 5, "expert parallelism (e2)", None),
    ("fsdp:p1d2e4", 9, "expert parallelism (e4)", "e1 is fine"),
    ("sglang:d4c1", 9, "sglang does not take context", None),
    ("vllm:d2t2e1", 9, "vllm does not take expert", None),
    ("sglang:d4c2", 9, "sglang does not take context", "replicas"),
    ("vllm:e2", 5, "vllm does not take expert", None),
    ("hf:d1c2", 5, "hf does not take context", None),
    ("megatron:d2e4", 11, "does not divide", None),
    ("megatron:d2p2e4", 13, "does not divide", None),
    ("sglang:d4 fsdp:d4", 10, "expected '+' or '|'", None),
    ("sglang:d4+", 10, "expected a component at the end", None),
    ("+fsdp:d4", 0, "expected a component before '+'", None),
    ("sglang:d4++fsdp:d4", 10, "expected a component before '+'", None),
    ("sglang:d4|", 10, "expected a component", None),
    ("sglang:d4)", 9, "unexpected ')'", None),
    ("sglang:d4.", 9, "unexpected '.'", None),
    ("sglang:d4;fsdp:d4", 9, "unexpected ';'", None),
    ("sglang[]:d4", 7, "expected a name", None),
    ("sglang[1a]:d4", 7, "expected a name", None),
    ("sglang[a b]:d4", 9, "expected ']'", None),
    ("fsdp[actor-0]:d4", 10, "'-' is not allowed in a name", "write fsdp[actor_0]"),
    ("sglang[r.1]:d4", 8, "'.' is not allowed in a name", "sglang[r_1]"),
    ("sglang[é]:d4", 7, "expected a name", None),
    ("sglang[a]:d4+fsdp[a]:d4", 18, "'a' is used twice", None),
    ("sglang[a]:d2|fsdp[a]:d2", 18, "'a' is used twice", None),
    ("sglang:d4+fsdp:d4+fsdp:d2", 6, "every one needs a name", "sglang[name]"),
    ("sglang[r]:d4+fsdp:d4+fsdp[c]:d2", 17, "every one needs a name", "fsdp[name]"),
    ("sglang[r]:d2+fsdp[a]:d4|fsdp:d4", 28, "colocated components ('|') need names", None),
    ("sglang:d2|fsdp[a]:d2", 6, "colocated components ('|') need names", None),
    ("sglang[a]:d4|fsdp[b]:d2", 13, "equal world sizes: 'a' has 4, 'b' has 2", "'+'"),
    ("megatron:(attn:d2p2|ffn:p1e2)", 24, "ffn p1 differs from attn p2", None),
    ("megatron:(attn:d3|ffn:e2)", 18, "cannot derive ffn d", None),
    ("megatron:(attn:d4|ffn:d4e2)", 18, "ffn world size 8", "omit ffn d"),
    ("megatron:(attn:d2|ffn:e2", 24, "expected ')'", None),
    ("megatron:attn:d2|ffn:e2)", 23, "unexpected ')'", None),
    ("megatron:(attn:d2 ffn:e2)", 18, "expected '|' before 'ffn'", None),
    ("megatron:(attn:d2)", 17, "expected '|ffn:'", None),
    ("megatron:(attn:d2|fn:e2)", 18, "expected 'ffn:'", None),
    ("megatron:(attn d2|ffn:e2)", 15, "expected ':' after 'attn'", None),
    ("megatron:(attn:d2e2|ffn:e2)", 17, "attn part does not take expert", None),
    ("megatron:(attn:d2|ffn:c2)", 22, "ffn part does not take context", None),
    ("megatron:(attn:|ffn:e2)", 15, "expected dimensions after 'attn'", None),
    ("fsdp:(attn:d2|ffn:e2)", 5, "not for fsdp", "megatron"),
    ("fsdp:(attn:d2|ffn:d2)", 5, "not for fsdp", None),
    ("megatron[a]:(attn:d2|ffn:e2)", 8, "takes no [name]", "megatron[a]:d2t2e2"),
    ("archon [ b ] : attn:d2|ffn:e2", 7, "takes no [name]", "archon:(attn:"),
    ("megatron:attn:d2|ffn:e2|fsdp[b]:d2", 8, "colocated components ('|') need names", None),
    ("sglang:attn:d2|ffn:e2", 7, "not for sglang", None),
    ("(attn:d2|ffn:e2)", 0, "needs a train backend", None),
    ("attn:d2|ffn:e2", 0, "needs a train backend", None),
    ("sglang:d٣", 8, "bad size", None),
    ("sglang:d4\u00a0+fsdp:d2", 9, "unexpected '\\xa0'", None),
    # lark's WS, which AReaL ignores, has no vertical tab.
    ("sglang:d4\v+fsdp:d2", 9, "unexpected '\\x0b'", None),
]


@pytest.mark.parametrize(
    "text, position, message, hint", ERRORS, ids=[e[0] or "<empty>" for e in ERRORS]
)
def test_error_position_message_and_hint(text, position, message, hint):
    e = fails(text)
    assert (e.position, e.text) == (position, text)
    assert message in e.message, e.message
    assert e.hint
    if hint is not None:
        assert hint in e.hint, e.hint
    assert e.detail == caret(text, position)


def test_alloc_error_is_a_usage_error_with_caret_diagram():
    e = fails("fsdp:d4p2")
    assert isinstance(e, UsageError) and e.exit_code == EXIT_USAGE
    line, mark = e.detail.split("\n")
    assert line == "  fsdp:d4p2"
    assert mark == "  " + " " * 7 + "^"
    assert line[mark.index("^")] == "p"


def test_caret_under_wide_and_control_characters():
    assert caret("ab\tc", 3) == "  ab c\n     ^"
    # A full-width character takes two terminal cells.
    assert caret("全x", 1) == "  全x\n    ^"
    assert caret("ab", 2) == "  ab\n    ^"


def test_non_string_input():
    with pytest.raises(AllocError):
        parse(None)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- legacy


@pytest.mark.parametrize(
    "text, modern",
    [
        ("sglang.d4p1t1+d4p1t1", "sglang:d4t1+fsdp:d4"),
        ("sglang.d4p1t2+d2p1t2", "sglang:d4t2+fsdp:d2t2"),
        ("vllm.d2t2p1+d4p2t1", "vllm:d2t2+megatron:d4p2"),
        ("sglang.d16p1m1+d32p2m1", "sglang:d16t1+megatron:d32p2"),
        ("sglang.d4p1t1", "sglang:d4t1"),
        ("sglang.d4p1t1+eval", "sglang:d4t1"),
        ("sglang.d2p2t1+d4c2", "sglang:d2t1p2+fsdp:d4c2"),
        ("sglang.d4+fsdp.d4", "sglang:d4t1+fsdp:d4"),
    ],
)
def test_legacy_spelling_prints_modern_equivalent(text, modern):
    e = fails(text)
    assert e.position == text.index(".")
    assert "AReaL ≤0.3" in e.message
    assert e.hint == f"write {modern}"
    parse(modern)


def test_legacy_dot_without_a_modern_equivalent_still_points_at_the_dot():
    e = fails("sglang.d4c2+d4")
    assert e.position == 6
    assert "not '.'" in e.message and "backend:dims" in e.hint


# --------------------------------------------------------------------------- properties


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=60))
def test_arbitrary_text_parses_or_raises_alloc_error(text):
    _parse_or_alloc_error(text)


_FRAGMENTS = [
    *INFERENCE_BACKENDS,
    *TRAIN_BACKENDS,
    "attn", "ffn", "eval", ":", ".", "+", "|", "(", ")", "[", "]", " ", "\t",
    "d", "t", "p", "c", "e", "m", "x", "D",
    "0", "1", "2", "4", "8", "07", "99999999",
    "[a]", "[b]", "[actor]", "[r-1]", "d4", "t2", "p2", "c2", "e4", "d2t2",
    "attn:", "ffn:", "(attn:d2t2|ffn:e2)", "全", "\u00a0", "٣",
]  # fmt: skip


@settings(max_examples=1500, deadline=None)
@given(st.lists(st.sampled_from(_FRAGMENTS), max_size=14).map("".join))
def test_grammar_fragments_parse_or_raise_alloc_error(text):
    _parse_or_alloc_error(text)


@st.composite
def _single(draw) -> str:
    backend = draw(st.sampled_from(INFERENCE_BACKENDS + TRAIN_BACKENDS))
    name = draw(st.sampled_from(["", "[a]", "[b]", "[c]", "[d]"]))
    # Mostly the backend's own letters, so that a good share of strings is valid.
    letters = _letters_of(backend) if draw(st.integers(0, 4)) else "dtpce"
    sizes = draw(st.dictionaries(st.sampled_from(letters), st.integers(1, 4), min_size=1))
    return f"{backend}{name}:" + "".join(f"{k}{v}" for k, v in sizes.items())


@settings(max_examples=800, deadline=None)
@given(st.lists(st.tuples(_single(), st.sampled_from("+|")), min_size=1, max_size=4))
def test_well_formed_strings_agree_with_the_rules(parts):
    text = "".join(s + op for s, op in parts)[:-1]
    try:
        a = parse(text)
    except AllocError as e:
        assert 0 <= e.position <= len(text)
        return
    data = a.to_json()
    groups: dict[str | None, int] = {}
    for c in a.components:
        for letter in "dtpce":
            if letter not in _letters_of(c.backend):
                assert getattr(c, letter) == 1, (c, letter)
        assert c.world_size == c.d * c.t * c.p * c.c
        groups.setdefault(c.colocate_with or c.name or id(c), c.world_size)
        if c.colocate_with:
            assert a.get(c.colocate_with).world_size == c.world_size
    names = [c.name for c in a.components if c.name]
    assert len(names) == len(set(names))
    if len(a.components) >= 3:
        assert len(names) == len(a.components)
    assert data["world_size"] == a.world_size == sum(groups.values())


def _letters_of(backend: str) -> str:
    return "dtp" if backend in INFERENCE_BACKENDS else ("dtc" if backend == "fsdp" else "dtpce")


def _parse_or_alloc_error(text: str) -> None:
    try:
        a = parse(text)
    except AllocError as e:
        assert e.text == text and 0 <= e.position <= len(text)
        assert e.hint and e.detail
        return
    assert a.components and a.world_size >= 1
    a.to_json()
