"""AReaL's own allocation cases, one row each, through our parser.

Upstream, read at commit 4aef98d8d818af55b43621aaadba047ae10f4e77 of inclusionAI/AReaL:
  tests/test_allocation_mode.py   every test there is a row of UPSTREAM below (52 tests);
  areal/api/alloc_mode.py         the parser (ALLOCATION_GRAMMAR, a lark Earley grammar, and
                                  _ParallelStrategyTransformer), whose job-level entry point
                                  `_AllocationMode.from_str` is what `areal` says in each row.

PROBES are strings that file does not hold but that decide where the rules lie (explicit 1s,
duplicated letters, unnamed group leaders, ...). Their `areal` column was found by running
that commit's alloc_mode.py unchanged (lark 1.3.1), as were UPSTREAM's.

A row compares outcomes (accepted or refused) and, when accepted, every component's backend,
name, dims, world size and colocation, and the total world size. Error wording is ours
everywhere: a reason, a caret at `pos` and a hint instead of AReaL's exception messages, so a
refused row gives our position and a fragment of our message. Where our outcome differs from
AReaL's, `note` says why; test_rows_explain_every_difference enforces that.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from areal_cli.alloc import AllocError, FfnDims, parse

AREAL_COMMIT = "4aef98d8d818af55b43621aaadba047ae10f4e77"
UPSTREAM_TESTS = "tests/test_allocation_mode.py"


@dataclass(frozen=True)
class C:
    """One expected component: backend, dims (default 1), world size d·t·p·c."""

    backend: str
    world: int
    d: int = 1
    t: int = 1
    p: int = 1
    c: int = 1
    e: int = 1
    name: str | None = None
    colocate_with: str | None = None
    ffn: FfnDims | None = None


@dataclass(frozen=True)
class Accept:
    world: int
    components: tuple[C, ...]


@dataclass(frozen=True)
class Refuse:
    pos: int
    message: str


@dataclass(frozen=True)
class Row:
    source: str  # the upstream test, or "probe"
    text: str
    areal: bool  # AReaL's _AllocationMode.from_str accepts it
    want: Accept | Refuse
    note: str = field(default="")


def ok(world: int, *components: C) -> Accept:
    return Accept(world, components)


TC = "test_allocation_parsing"
VE = "test_validation_errors"
MA = "TestModelAllocationFromStr"
TE = "TestTrainEngineConfigBackendNormalization"
IE = "TestInferenceEngineConfigBackendNormalization"

MOE_4x2x2x2 = C("megatron", 32, d=4, t=2, p=2, c=2, e=2, ffn=FfnDims(d=2, t=4, p=2, e=2))
MOE_P12 = C("megatron", 48, t=4, p=12, e=4, ffn=FfnDims(d=1, t=1, p=12, e=4))

UPSTREAM = [
    # TEST_CASES, through test_allocation_parsing
    Row(f"{TC}[inf_only_modern_colon]", "sglang:d4p2t2", True,
        ok(16, C("sglang", 16, d=4, t=2, p=2))),
    Row(f"{TC}[disagg_modern_simple]", "sglang:d2+fsdp:d4", True,
        ok(6, C("sglang", 2, d=2), C("fsdp", 4, d=4))),
    Row(f"{TC}[disagg_with_hybrid_moe]",
        "sglang:d4p2t2+megatron:(attn:d2p2t2c2|ffn:d2p2t2e2)", True,
        ok(32, C("sglang", 16, d=4, t=2, p=2),
           C("megatron", 16, d=2, t=2, p=2, c=2, e=2, ffn=FfnDims(d=2, t=2, p=2, e=2)))),
    Row(f"{TC}[fsdp_explicit]", "fsdp:d4", True, ok(4, C("fsdp", 4, d=4))),
    Row(f"{TC}[megatron_explicit]", "megatron:d2p2t1", True,
        ok(4, C("megatron", 4, d=2, p=2))),
    Row(f"{TC}[disagg_different_backends]", "vllm:d2t4+megatron:d2p2t1", True,
        ok(12, C("vllm", 8, d=2, t=4), C("megatron", 4, d=2, p=2))),
    Row(f"{TC}[megatron_hybrid_moe]", "megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)", True,
        ok(32, MOE_4x2x2x2)),
    Row(f"{TC}[disagg_with_inf_and_hybrid]",
        "sglang:d4p1t2+megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)", True,
        ok(40, C("sglang", 8, d=4, t=2), MOE_4x2x2x2)),
    Row(f"{TC}[two_named_components]", "sglang[rollout]:d2+fsdp[actor]:d4", True,
        ok(6, C("sglang", 2, d=2, name="rollout"), C("fsdp", 4, d=4, name="actor"))),
    Row(f"{TC}[three_named_components]",
        "sglang[rollout]:d2+fsdp[actor]:d4+fsdp[critic]:d4", True,
        ok(10, C("sglang", 2, d=2, name="rollout"), C("fsdp", 4, d=4, name="actor"),
           C("fsdp", 4, d=4, name="critic"))),
    Row(f"{TC}[colocation_with_names]",
        "sglang[rollout]:d2+fsdp[actor]:d4|fsdp[critic]:d4", True,
        ok(6, C("sglang", 2, d=2, name="rollout"), C("fsdp", 4, d=4, name="actor"),
           C("fsdp", 4, d=4, name="critic", colocate_with="actor"))),
    Row(f"{TC}[multi_agent_allocation]",
        "vllm[rollout1]:d2t2 + fsdp[actor1]:d4 + vllm[rollout2]:d4 + fsdp[actor2]:d4", True,
        ok(16, C("vllm", 4, d=2, t=2, name="rollout1"), C("fsdp", 4, d=4, name="actor1"),
           C("vllm", 4, d=4, name="rollout2"), C("fsdp", 4, d=4, name="actor2"))),
    # VALIDATION_ERROR_CASES, through test_validation_errors (two share the id fsdp_pipeline,
    # which pytest numbers; the second is expert parallelism)
    Row(f"{VE}[fsdp_pipeline0]", "fsdp:d4p2", False,
        Refuse(7, "fsdp does not take pipeline parallelism (p2)")),
    Row(f"{VE}[fsdp_pipeline1]", "fsdp:d2e2", False,
        Refuse(7, "fsdp does not take expert parallelism (e2)")),
    Row(f"{VE}[three_plus_without_names]", "sglang:d2+fsdp[actor]:d4+fsdp:d4", False,
        Refuse(6, "with 3 components every one needs a name")),
    Row(f"{VE}[duplicate_names]", "sglang[actor]:d2+fsdp[actor]:d4", False,
        Refuse(22, "name 'actor' is used twice")),
    Row(f"{VE}[colocation_without_names]", "fsdp:d4|fsdp:d4", False,
        Refuse(4, "colocated components ('|') need names")),
    Row(f"{VE}[hybrid_pp_mismatch]", "(attn:d2p2t1c4|ffn:d2p4t1e2)", False,
        Refuse(0, "the attn|ffn form needs a train backend"),
        "same outcome, other first error: AReaL checks the dims before it sees no backend; "
        "we report the leftmost problem (the probe with megatron: shows the p mismatch)"),
    Row(f"{VE}[hybrid_world_mismatch]", "(attn:d4p2t1c1|ffn:d2p2t2e2)", False,
        Refuse(0, "the attn|ffn form needs a train backend"),
        "same outcome, other first error, as hybrid_pp_mismatch"),
    Row(f"{VE}[bare_dims_simple]", "d1", False, Refuse(0, "missing backend")),
    Row(f"{VE}[bare_dims_complex]", "d2p2t1", False, Refuse(0, "missing backend")),
    Row(f"{VE}[bare_dims_with_name]", "[actor]:d4", False, Refuse(0, "missing backend")),
    Row(f"{VE}[bare_dims_in_multi_component]", "sglang:d4+d4", False,
        Refuse(10, "missing backend")),
    Row(f"{VE}[bare_dims_named_in_multi]", "vllm:d4+[actor]:d4", False,
        Refuse(8, "missing backend")),
    Row(f"{VE}[bare_hybrid_moe_no_backend]", "attn:d4p2t2c2|ffn:d2p2t4e2", False,
        Refuse(0, "the attn|ffn form needs a train backend")),
    Row(f"{VE}[bare_hybrid_moe_parens_no_backend]", "(attn:d4p2t2c2|ffn:d2p2t4e2)", False,
        Refuse(0, "the attn|ffn form needs a train backend")),
    # test_backward_compatible_properties: .gen/.train/gen_instance_size; see
    # test_single_part_accessors for how ours answer the same questions
    Row("test_backward_compatible_properties", "sglang:d2+fsdp:d4", True,
        ok(6, C("sglang", 2, d=2), C("fsdp", 4, d=4))),
    Row("test_backward_compatible_properties",
        "sglang[r1]:d2+sglang[r2]:d2+fsdp[actor]:d4", True,
        ok(8, C("sglang", 2, d=2, name="r1"), C("sglang", 2, d=2, name="r2"),
           C("fsdp", 4, d=4, name="actor"))),
    Row("test_backward_compatible_properties",
        "sglang[rollout]:d2+fsdp[actor]:d4+fsdp[critic]:d4", True,
        ok(10, C("sglang", 2, d=2, name="rollout"), C("fsdp", 4, d=4, name="actor"),
           C("fsdp", 4, d=4, name="critic"))),
    Row("test_getitem_access", "sglang[rollout]:d2+fsdp[actor]:d4", True,
        ok(6, C("sglang", 2, d=2, name="rollout"), C("fsdp", 4, d=4, name="actor"))),
    Row("test_operator_precedence", "sglang[rollout]:d2+fsdp[actor]:d4|fsdp[critic]:d4", True,
        ok(6, C("sglang", 2, d=2, name="rollout"), C("fsdp", 4, d=4, name="actor"),
           C("fsdp", 4, d=4, name="critic", colocate_with="actor"))),
    # ModelAllocation.from_str, the per-engine parser of one component
    Row(f"{MA}::test_fsdp_simple", "fsdp:d4", True, ok(4, C("fsdp", 4, d=4))),
    Row(f"{MA}::test_sglang_with_tp", "sglang:d4t2", True, ok(8, C("sglang", 8, d=4, t=2))),
    Row(f"{MA}::test_vllm_with_pp", "vllm:d2t4p2", True,
        ok(16, C("vllm", 16, d=2, t=4, p=2))),
    Row(f"{MA}::test_megatron_full", "megatron:d4t2p2", True,
        ok(16, C("megatron", 16, d=4, t=2, p=2))),
    Row(f"{MA}::test_archon_simple", "archon:d2", True, ok(2, C("archon", 2, d=2))),
    Row(f"{MA}::test_hybrid_moe", "megatron:(attn:d1p12t4|ffn:d1p12e4)", True,
        ok(48, MOE_P12)),
    Row(f"{MA}::test_with_name", "fsdp[actor]:d4", True,
        ok(4, C("fsdp", 4, d=4, name="actor")),
        "upstream passes name='actor' as an argument; a job string writes it fsdp[actor]:d4"),
    Row(f"{MA}::test_with_scheduling_strategy", "fsdp[actor]:d4|fsdp[ref]:d4", True,
        ok(4, C("fsdp", 4, d=4, name="actor"), C("fsdp", 4, d=4, name="ref",
                                                  colocate_with="actor")),
        "upstream passes colocation with 'actor' as an argument; a job string writes '|'"),
    Row(f"{MA}::test_default_scheduling_is_separation", "fsdp:d4", True,
        ok(4, C("fsdp", 4, d=4))),
    Row(f"{MA}::test_world_size", "fsdp:d4t2", True, ok(8, C("fsdp", 8, d=4, t=2))),
    Row(f"{MA}::test_context_parallel", "fsdp:d4c2", True, ok(8, C("fsdp", 8, d=4, c=2))),
    Row(f"{MA}::test_single_gpu", "fsdp:d1", True, ok(1, C("fsdp", 1))),
    Row(f"{MA}::test_sglang_d1", "sglang:d1", True, ok(1, C("sglang", 1))),
    Row(f"{MA}::test_rejects_multi_component", "sglang:d4+fsdp:d4", True,
        ok(8, C("sglang", 4, d=4), C("fsdp", 4, d=4)),
        "the per-engine ModelAllocation.from_str refuses any '+'; `parse` reads a whole job's "
        "string, as _AllocationMode.from_str does, which accepts it"),
    Row(f"{MA}::test_rejects_multi_component_three_parts", "sglang:d2+fsdp:d4+megatron:d8",
        False, Refuse(6, "with 3 components every one needs a name"),
        "the per-engine parser refuses the '+'; the job-level one, like ours, the missing names"),
    # engine configs keep their backend string; each must parse
    Row(f"{TE}::test_explicit_fsdp_preserved", "fsdp:d4", True, ok(4, C("fsdp", 4, d=4))),
    Row(f"{TE}::test_explicit_megatron_preserved", "megatron:d4t2p2", True,
        ok(16, C("megatron", 16, d=4, t=2, p=2))),
    Row(f"{TE}::test_explicit_archon_preserved", "archon:d2", True, ok(2, C("archon", 2, d=2))),
    Row(f"{TE}::test_hybrid_moe_preserved", "megatron:(attn:d1p12t4|ffn:d1p12e4)", True,
        ok(48, MOE_P12)),
    Row(f"{TE}::test_single_gpu_default", "fsdp:d1", True, ok(1, C("fsdp", 1))),
    Row(f"{IE}::test_explicit_sglang_preserved", "sglang:d4t2", True,
        ok(8, C("sglang", 8, d=4, t=2))),
    Row(f"{IE}::test_explicit_vllm_preserved", "vllm:d2t4", True, ok(8, C("vllm", 8, d=2, t=4))),
    Row(f"{IE}::test_single_gpu_default", "sglang:d1", True, ok(1, C("sglang", 1))),
]  # fmt: skip

# Every test function and parametrized case in the upstream file, as pytest names them.
UPSTREAM_TEST_IDS = {
    *(f"{TC}[{i}]" for i in (
        "inf_only_modern_colon", "disagg_modern_simple", "disagg_with_hybrid_moe",
        "fsdp_explicit", "megatron_explicit", "disagg_different_backends",
        "megatron_hybrid_moe", "disagg_with_inf_and_hybrid", "two_named_components",
        "three_named_components", "colocation_with_names", "multi_agent_allocation")),
    *(f"{VE}[{i}]" for i in (
        "fsdp_pipeline0", "fsdp_pipeline1", "three_plus_without_names", "duplicate_names",
        "colocation_without_names", "hybrid_pp_mismatch", "hybrid_world_mismatch",
        "bare_dims_simple", "bare_dims_complex", "bare_dims_with_name",
        "bare_dims_in_multi_component", "bare_dims_named_in_multi",
        "bare_hybrid_moe_no_backend", "bare_hybrid_moe_parens_no_backend")),
    "test_backward_compatible_properties", "test_getitem_access", "test_operator_precedence",
    *(f"{MA}::{t}" for t in (
        "test_fsdp_simple", "test_sglang_with_tp", "test_vllm_with_pp", "test_megatron_full",
        "test_archon_simple", "test_hybrid_moe", "test_with_name",
        "test_with_scheduling_strategy", "test_default_scheduling_is_separation",
        "test_world_size", "test_context_parallel", "test_single_gpu", "test_sglang_d1",
        "test_rejects_multi_component", "test_rejects_multi_component_three_parts")),
    *(f"{TE}::{t}" for t in (
        "test_explicit_fsdp_preserved", "test_explicit_megatron_preserved",
        "test_explicit_archon_preserved", "test_hybrid_moe_preserved",
        "test_single_gpu_default")),
    *(f"{IE}::{t}" for t in (
        "test_explicit_sglang_preserved", "test_explicit_vllm_preserved",
        "test_single_gpu_default")),
}  # fmt: skip

P = "probe"
PROBES = [
    # A 1 is allowed wherever AReaL's grammar has the letter (fsdp refuses only p > 1, e > 1).
    Row(P, "fsdp:d2p1t1", True, ok(2, C("fsdp", 2, d=2)), "from AReaL issue #752"),
    Row(P, "fsdp:d2e1", True, ok(2, C("fsdp", 2, d=2))),
    Row(P, "fsdp:d1t1c1p1e1", True, ok(1, C("fsdp", 1))),
    Row(P, "fsdp:d2 p1", True, ok(2, C("fsdp", 2, d=2))),
    Row(P, "megatron:c1e1p1", True, ok(1, C("megatron", 1))),
    Row(P, "vllm:d2t2p1", True, ok(4, C("vllm", 4, d=2, t=2))),
    # ...and nowhere else: inference takes d, t, p only; the attn part has no e, ffn no c.
    Row(P, "sglang:d4c1", False, Refuse(9, "sglang does not take context parallelism")),
    Row(P, "sglang:d4e1", False, Refuse(9, "sglang does not take expert parallelism")),
    Row(P, "vllm:d2c1", False, Refuse(7, "vllm does not take context parallelism")),
    Row(P, "megatron:(attn:d2e1|ffn:e2)", False, Refuse(17, "attn part does not take expert")),
    Row(P, "megatron:(attn:d2|ffn:c1)", False, Refuse(22, "ffn part does not take context")),
    Row(P, "fsdp:(attn:d2p2|ffn:e1)", False, Refuse(5, "not for fsdp")),
    # Expert parallelism must divide a pipeline stage (AReaL: world % (p·e) == 0).
    Row(P, "megatron:d4p2e4", True, ok(8, C("megatron", 8, d=4, p=2, e=4))),
    Row(P, "megatron:d2e4", False, Refuse(11, "e4 does not divide the 2 GPUs")),
    Row(P, "megatron:d2p2e4", False, Refuse(13, "e4 does not divide the 2 GPUs")),
    # The MoE checks behind the backend-less upstream cases.
    Row(P, "megatron:(attn:d2p2t1c4|ffn:d2p4t1e2)", False, Refuse(30, "ffn p4 differs")),
    Row(P, "megatron:(attn:d4p2t1c1|ffn:d2p2t2e2)", False, Refuse(24, "ffn world size 16")),
    Row(P, "megatron:(attn:d3|ffn:e2)", False, Refuse(18, "cannot derive ffn d")),
    Row(P, "megatron:(attn:p2d2|ffn:e2)", True,
        ok(4, C("megatron", 4, d=2, p=2, e=2, ffn=FfnDims(d=1, t=1, p=2, e=2)))),
    Row(P, "megatron:attn:d2|ffn:e2", True,
        ok(2, C("megatron", 2, d=2, e=2, ffn=FfnDims(d=1, t=1, p=1, e=2)))),
    # Whitespace is lark's WS: space, tab, CR, LF, FF; not VT.
    Row(P, "sglang : d4 t2 + fsdp : d 8", True,
        ok(16, C("sglang", 8, d=4, t=2), C("fsdp", 8, d=8))),
    Row(P, "sglang [ r ] :\r\n d4", True, ok(4, C("sglang", 4, d=4, name="r"))),
    Row(P, "sglang:d4\v+fsdp:d2", False, Refuse(9, "unexpected '\\x0b'")),
    # Names are AReaL's NAME, [A-Za-z_][A-Za-z0-9_]*.
    Row(P, "sglang[_r9]:d2+fsdp[A_b]:d4", True,
        ok(6, C("sglang", 2, d=2, name="_r9"), C("fsdp", 4, d=4, name="A_b"))),
    Row(P, "fsdp[actor-0]:d4", False, Refuse(10, "'-' is not allowed in a name")),
    Row(P, "sglang[9r]:d4", False, Refuse(7, "expected a name")),
    # AReaL has no named MoE form (train_backend_with_name takes plain dims only).
    Row(P, "megatron[actor]:(attn:d4t2|ffn:t2e4)", False, Refuse(8, "takes no [name]")),
    Row(P, "archon[actor]:attn:d4t2|ffn:t2e4", False, Refuse(6, "takes no [name]")),
    Row(P, "megatron[actor]:d4t2e4", True, ok(8, C("megatron", 8, d=4, t=2, e=4, name="actor"))),
    # Old spellings and other letters.
    Row(P, "sglang.d4p1t1+d4p1t1", False, Refuse(6, "AReaL ≤0.3 spelling")),
    Row(P, "sglang:d4m2", False, Refuse(9, "unknown dimension 'm'")),
    Row(P, "SGLang:d4", False, Refuse(0, "unknown backend")),
    Row(P, "sglang:d0", False, Refuse(8, "positive integer")),
    Row(P, "sglang:d4+eval", False, Refuse(10, "unknown backend 'eval'")),
    # Where we deliberately differ.
    Row(P, "hf:d1", False, ok(1, C("hf", 1)),
        "hf is our CPU-capable reference server (inference: d, t, p); AReaL has no hf backend"),
    Row(P, "hf:d2+fsdp:d2", False, ok(4, C("hf", 2, d=2), C("fsdp", 2, d=2)),
        "hf, as above"),
    Row(P, "fsdp:d2d4", True, Refuse(7, "dimension 'd' given twice"),
        "AReaL keeps the last (d4) without a word; a repeated letter is a typo we point at"),
    Row(P, "megatron:t2d2t2", True, Refuse(13, "dimension 't' given twice"), "as fsdp:d2d4"),
    Row(P, "sglang:d2|fsdp[a]:d2", True, Refuse(6, "colocated components ('|') need names"),
        "AReaL checks names on the members after the first only, and records fsdp[a] as "
        "colocated with target None; its docs say '|' needs names, and ours must name whom "
        "the others share GPUs with"),
    Row(P, "megatron:(attn:d2|ffn:e2)|sglang[r]:d2", True,
        Refuse(8, "colocated components ('|') need names"),
        "as sglang:d2|fsdp[a]:d2; and the MoE form cannot be named (AReaL's grammar)"),
    Row(P, "megatron:(attn:d2|ffn:e2", True, Refuse(24, "expected ')'"),
        "AReaL's grammar makes '(' and ')' optional each on its own; a lone one is a typo"),
    Row(P, "megatron:attn:d2|ffn:e2)", True, Refuse(23, "unexpected ')'"),
        "as the lone '('"),
    Row(P, "fsdp:(attn:d4|ffn:t2)", True, Refuse(5, "not for fsdp"),
        "AReaL lets any train backend into the attn|ffn form and checks only fsdp's p and e, "
        "keeping an expert layout (ffn t2) that fsdp has no experts to use; its docs give the "
        "form for Megatron and Archon only"),
    Row(P, "fsdp:(attn:d2|ffn:d2)", True, Refuse(5, "not for fsdp"), "as fsdp:(attn:d4|ffn:t2)"),
    Row(P, "sglang:d99999999", True, Refuse(8, "too large"),
        "sizes above a million GPUs are typos; the cap also bounds int() on the input"),
]  # fmt: skip


def _outcome(text: str) -> Accept | Refuse:
    try:
        a = parse(text)
    except AllocError as e:
        return Refuse(e.position, e.message)
    comps = tuple(
        C(c.backend, c.world_size, c.d, c.t, c.p, c.c, c.e, c.name, c.colocate_with, c.ffn)
        for c in a.components
    )
    return Accept(a.world_size, comps)


ROWS = UPSTREAM + PROBES
IDS = [f"{r.source}:{r.text}" for r in ROWS]


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_case(row: Row):
    got = _outcome(row.text)
    if isinstance(row.want, Accept):
        assert got == row.want
    else:
        assert isinstance(got, Refuse), f"{row.text!r} was accepted: {got}"
        assert got.pos == row.want.pos and row.want.message in got.message, got


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_rows_explain_every_difference(row: Row):
    if isinstance(row.want, Accept) != row.areal:
        assert row.note, f"{row.text!r}: we differ from AReaL without saying why"


def test_every_upstream_test_has_a_row():
    assert {r.source for r in UPSTREAM} == UPSTREAM_TEST_IDS
    assert len(UPSTREAM_TEST_IDS) == 52


def test_single_part_accessors():
    """test_backward_compatible_properties and test_getitem_access, in our API.

    AReaL's .gen/.train raise "Ambiguous" when two parts qualify, and [name] raises KeyError;
    we list the inference parts, take the first train part (what `areal train` runs), and
    return None for a missing name. gen_instance_size (t·p) is our gpus_per_replica.
    """
    a = parse("sglang:d2+fsdp:d4")
    (gen,) = a.inference
    assert (gen.d, gen.gpus_per_replica, gen.backend) == (2, 1, "sglang")
    assert (a.train.d, a.train.backend) == (4, "fsdp")
    assert [c.name for c in parse("sglang[r1]:d2+sglang[r2]:d2+fsdp[actor]:d4").inference] == [
        "r1",
        "r2",
    ]
    assert parse("sglang[rollout]:d2+fsdp[actor]:d4+fsdp[critic]:d4").train.name == "actor"
    b = parse("sglang[rollout]:d2+fsdp[actor]:d4")
    assert b.get("rollout").backend == "sglang" and b.get("nonexistent") is None
