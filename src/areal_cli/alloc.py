"""Allocation strings: the one parser and validator for how a job spreads over GPUs.

Grammar: AReaL's (`areal/api/alloc_mode.py`, ALLOCATION_GRAMMAR), plus the `hf` backend:

    expr      := component ("+" component)*     "+" = separate GPUs
    component := single ("|" single)*            "|" = colocated, binds tighter than "+"
    single    := INF ("[" name "]")? ":" dims     INF   = sglang | vllm | hf
               | TRAIN ("[" name "]")? ":" dims   TRAIN = fsdp | megatron | archon
               | MOE ":" ("(" moe ")" | moe)      MOE   = megatron | archon
    moe       := "attn:" dims "|" "ffn:" dims
    dims      := (d|t|p|c|e)N ...                N >= 1, no leading zero

    d data parallel (inference: server replicas) · t tensor · p pipeline · c context · e expert

World size of a single is d·t·p·c (`e` adds no GPUs); missing dimensions are 1. Inference
backends take d, t, p (c and e not even as 1); train backends take all five letters, but fsdp
refuses p > 1 and e > 1 (`fsdp:d2p1t1` is fine). The MoE form (megatron/archon only, without a
name) gives attention dims d, t, p, c and expert (ffn) dims d, t, p, e: ffn p defaults to attn
p and must equal it, ffn d defaults to attn_world / (ffn t·p·e).

Validation: an explicit backend is required; three or more singles need names; names are
unique; every single in a "|" group has a name and the group shares one world size. Names
match AReaL's `[A-Za-z_][A-Za-z0-9_]*`.

Stricter than AReaL where it lets through a typo or a layout nothing uses: a dimension given twice (AReaL keeps the
last), an unnamed first member of a "|" group (AReaL records a colocation with no target), a
lone "(" or ")" around the MoE form, the MoE form under fsdp, sizes above a million.

Whitespace (AReaL's: space, tab, CR, LF, FF) is allowed and ignored between any two tokens:
`sglang : d4 t2 + fsdp : d 8` is fine. A token never contains it: a backend, a name, a
keyword (`attn`, `ffn`) or a number is written without spaces inside.

Every problem raises `AllocError` (a `UsageError`, exit 2) with the 0-based position of the
offending character, a caret diagram and one hint; nothing else escapes `parse`.
"""

from __future__ import annotations

import re
import unicodedata

from areal_cli import plugins
from areal_cli.errors import UsageError
from areal_cli.plain import Frozen, Plain

TRAIN_BACKENDS = ("fsdp", "megatron", "archon")


def inference_backends() -> tuple[str, ...]:
    """The inference engines an allocation may name: those installed (the entry points of
    areal_cli.engines; asked of plugins, not backends, which imports the allocation's spec)."""
    return tuple(plugins.names(plugins.ENGINES))


def all_backends() -> tuple[str, ...]:
    return inference_backends() + TRAIN_BACKENDS


def __getattr__(name: str):
    # INFERENCE_BACKENDS and BACKENDS, asked of the engines installed when read.
    if name == "INFERENCE_BACKENDS":
        return inference_backends()
    if name == "BACKENDS":
        return all_backends()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


DIMS = "dtpce"
# The dimension letters each kind of backend takes.
_INFERENCE_DIMS = "dtp"
# Letters fsdp reads but only as 1, as AReaL's ModelAllocation check does.
_FSDP_ONLY_ONE = "pe"
_ATTN_DIMS = "dtpc"
_FFN_DIMS = "dtpe"
_DIM_WORDS = {"d": "data", "t": "tensor", "p": "pipeline", "c": "context", "e": "expert"}
# Sizes above this are typos, and capping digits keeps int() away from huge inputs.
_MAX_DIM = 1_000_000

_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# lark's common.WS, which AReaL's grammar ignores.
_WS = " \t\r\n\f"
# Dims without a backend (`d4t2`, AReaL's old colocated form); `m` was AReaL's tensor letter.
_BARE_DIMS_RE = re.compile(r"(?:[dtpcem][ \t\r\n\f]*[0-9]+[ \t\r\n\f]*)+")


class AllocError(UsageError):
    """A bad allocation string: where (0-based `position` into `text`), why, and one hint."""

    def __init__(self, reason: str, *, text: str, position: int, hint: str | None = None):
        position = max(0, min(position, len(text)))
        super().__init__(f"bad allocation: {reason}", hint=hint, detail=caret(text, position))
        self.reason = reason
        self.text = text
        self.position = position


def caret(text: str, position: int) -> str:
    """Two lines: the string, and a caret under the character at `position`."""
    shown, pad = [], 0
    for i, ch in enumerate(text):
        if not ch.isprintable():
            ch = " "
        shown.append(ch)
        if i < position:
            pad += _cell_width(ch)
    return "  " + "".join(shown) + "\n  " + " " * pad + "^"


def _cell_width(ch: str) -> int:
    if unicodedata.combining(ch):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in "WF" else 1


class FfnDims(Frozen):
    """Expert (ffn) layout of the MoE form; its world size d·t·p·e equals the attention one."""

    __slots__ = ("d", "t", "p", "e")

    def __init__(self, d: int, t: int, p: int, e: int):
        self._freeze(d, t, p, e)


class Component(Frozen):
    """One single of the string: a backend with its parallel dims (attention dims for MoE)."""

    __slots__ = ("name", "backend", "d", "t", "p", "c", "e", "colocate_with", "ffn")

    def __init__(
        self,
        name: str | None,
        backend: str,
        d: int,
        t: int,
        p: int,
        c: int,
        e: int,
        colocate_with: str | None,
        ffn: FfnDims | None = None,
    ):
        self._freeze(name, backend, d, t, p, c, e, colocate_with, ffn)

    @property
    def role(self) -> str:
        return "inference" if self.backend in inference_backends() else "train"

    @property
    def world_size(self) -> int:
        return self.d * self.t * self.p * self.c

    @property
    def gpus_per_replica(self) -> int:
        """GPUs of one server (t·p) or of one data-parallel trainer replica (t·p·c)."""
        if self.role == "inference":
            return self.t * self.p
        return self.t * self.p * self.c

    def to_json(self) -> dict:
        data = {
            "name": self.name,
            "backend": self.backend,
            "role": self.role,
            "d": self.d,
            "t": self.t,
            "p": self.p,
            "c": self.c,
            "e": self.e,
            "world_size": self.world_size,
            "gpus_per_replica": self.gpus_per_replica,
            "colocate_with": self.colocate_with,
        }
        if self.ffn is not None:
            data["ffn"] = self.ffn.to_json()
        return data


class Allocation(Frozen):
    __slots__ = ("text", "components")

    def __init__(self, text: str, components: tuple[Component, ...]):
        self._freeze(text, components)

    @property
    def world_size(self) -> int:
        """GPUs the whole string needs: a colocated group is counted once."""
        return sum(c.world_size for c in self.components if c.colocate_with is None)

    @property
    def inference(self) -> tuple[Component, ...]:
        return tuple(c for c in self.components if c.role == "inference")

    @property
    def train(self) -> Component | None:
        return next((c for c in self.components if c.role == "train"), None)

    def get(self, name: str) -> Component | None:
        return next((c for c in self.components if c.name == name), None)

    def to_json(self) -> dict:
        return {
            "text": self.text,
            "world_size": self.world_size,
            "components": [c.to_json() for c in self.components],
        }


def parse(text: str) -> Allocation:
    """Parse and validate an allocation string; raise AllocError on anything wrong with it."""
    if not isinstance(text, str):
        raise AllocError(
            f"expected a string, got {type(text).__name__}",
            text="",
            position=0,
            hint="write e.g. sglang:d4t1+fsdp:d4",
        )
    return _Parser(text).parse()


# --------------------------------------------------------------------------- parser


class _Single(Plain):
    __slots__ = ("start", "backend", "name", "name_pos", "dims", "ffn")

    def __init__(
        self,
        start: int,
        backend: str,
        name: str | None,
        name_pos: int,
        dims: dict[str, int],
        ffn: FfnDims | None = None,
    ):
        self.start, self.backend, self.name, self.name_pos = start, backend, name, name_pos
        self.dims, self.ffn = dims, ffn

    @property
    def world(self) -> int:
        return self.dims["d"] * self.dims["t"] * self.dims["p"] * self.dims["c"]


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.pos = 0

    # ---- scanning

    def fail(self, reason: str, position: int, hint: str | None = None):
        raise AllocError(reason, text=self.text, position=position, hint=hint)

    def skip_ws(self) -> str:
        """Skip whitespace; return the next character ('' at the end)."""
        while self.pos < len(self.text) and self.text[self.pos] in _WS:
            self.pos += 1
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def word_at(self, pos: int) -> str:
        m = _NAME_RE.match(self.text, pos)
        return m.group(0) if m else ""

    def expect(self, ch: str, reason: str, hint: str | None = None) -> None:
        if self.skip_ws() != ch:
            self.fail(reason, self.pos, hint)
        self.pos += 1

    # ---- grammar

    def parse(self) -> Allocation:
        if not self.skip_ws():
            self.fail(
                "the allocation is empty",
                self.pos,
                "write e.g. sglang:d4t1 (servers), fsdp:d2 (trainer) or sglang:d4+fsdp:d4",
            )
        groups: list[list[_Single]] = []
        while True:
            group = [self.single()]
            while self.skip_ws() == "|":
                self.pos += 1
                group.append(self.single())
            groups.append(group)
            if self.skip_ws() != "+":
                break
            self.pos += 1
        ch = self.skip_ws()
        if ch == ")":
            self.fail(
                "unexpected ')'",
                self.pos,
                "'(' ')' only wrap the MoE form: megatron:(attn:…|ffn:…)",
            )
        if ch:
            self.fail(
                f"unexpected {ch!r}",
                self.pos,
                "join components with '+' (separate GPUs) or '|' (shared GPUs)",
            )
        return self.validate(groups)

    def single(self) -> _Single:
        """backend, an optional [name], ':' and the dims (or the attn|ffn form)."""
        self.skip_ws()
        start = self.pos
        backend = self._backend()
        self.pos = start + len(backend)
        name, name_pos, bracket = self._name(backend)
        ch = self.skip_ws()
        if ch == ".":
            self._fail_legacy(self.pos)
        if ch != ":":
            label = f"{backend}[{name}]" if name else backend
            self.fail(f"expected ':' after {label!r}", self.pos, f"write e.g. {label}:d4")
        self.pos += 1

        ch = self.skip_ws()
        if ch == "(" or self.word_at(self.pos) == "attn":
            if name is not None and backend in ("megatron", "archon"):
                # AReaL's grammar has no named MoE form; its trainer would refuse this string.
                self.fail(
                    "the attn|ffn form takes no [name]",
                    bracket,
                    f"write {backend}:(attn:…|ffn:…), or name a plain one: "
                    f"{backend}[{name}]:d2t2e2",
                )
            return self.moe(start, backend, name, name_pos)
        return self._plain(start, backend, name, name_pos)

    def _backend(self) -> str:
        """The backend word at the start of a component; what stands there instead (an
        operator, a name, bare dims, a typo) is named with its hint."""
        start = self.pos
        ch = self.text[start] if start < len(self.text) else ""
        if ch in ("", "+", "|", ")"):
            where = "at the end" if not ch else f"before {ch!r}"
            self.fail(
                f"expected a component {where}",
                start,
                "a component is backend:dims, e.g. sglang:d4t1 or fsdp:d4",
            )
        if ch == "[":
            self.fail(
                "missing backend before the name",
                start,
                "put the backend first: sglang[name]:d4 or fsdp[name]:d4",
            )
        if ch == "(":
            self.fail(
                "the attn|ffn form needs a train backend",
                start,
                "write megatron:(attn:d2t2|ffn:e4) or archon:(…)",
            )
        bare = _BARE_DIMS_RE.match(self.text, start)
        if bare and self._ends_component(bare.end()):
            self._fail_bare_dims(start, bare.group(0))
        word = self.word_at(start)
        if not word:
            self.fail(
                f"unexpected {ch!r}",
                start,
                "a component is backend:dims, e.g. sglang:d4t1 or fsdp:d4",
            )
        if word in ("attn", "ffn"):
            self.fail(
                "the attn|ffn form needs a train backend",
                start,
                "write megatron:(attn:d2t2|ffn:e4) or archon:(…)",
            )
        known_names = all_backends()
        if word not in known_names:
            import difflib  # here: a typo's hint only (difflib and heapq, 1 ms of `areal alloc`)

            close = difflib.get_close_matches(word.lower(), known_names, n=1, cutoff=0.6)
            known = "backends: " + ", ".join(known_names)
            hint = f"did you mean {close[0]}? {known}" if close else known
            self.fail(f"unknown backend {word!r}", start, hint)
        return word

    def _name(self, backend: str) -> tuple[str | None, int, int]:
        """An optional `[name]` after the backend: the name (None), where it starts, and
        where its '[' stands."""
        name, name_pos = None, self.pos
        ch = self.skip_ws()
        bracket = self.pos
        if ch == "[":
            self.pos += 1
            self.skip_ws()
            name_pos = self.pos
            name = self.word_at(self.pos)
            if not name:
                self.fail(
                    "expected a name inside '[ ]'",
                    self.pos,
                    "names start with a letter or '_' and hold letters, digits and '_'",
                )
            self.pos += len(name)
            self.name_end(backend, name)
        return name, name_pos, bracket

    def _plain(self, start: int, backend: str, name: str | None, name_pos: int) -> _Single:
        """The dims of a component that is not the attn|ffn form, checked for its backend."""
        allowed = _INFERENCE_DIMS if backend in inference_backends() else DIMS
        dims = self.dims(backend, allowed)
        if backend == "fsdp":
            self._check_fsdp(dims)
        single = _Single(start, backend, name, name_pos, _filled(dims))
        if single.dims["e"] > 1:
            # Megatron splits experts within one pipeline stage's data-parallel ranks.
            per_stage = single.world // single.dims["p"]
            if per_stage % single.dims["e"]:
                self.fail(
                    f"e{single.dims['e']} does not divide the {per_stage} GPUs of a "
                    f"pipeline stage (world {single.world} / p{single.dims['p']})",
                    dims["e"][1],
                    "expert parallel size must divide d·t·c",
                )
        return single

    def name_end(self, backend: str, name: str) -> None:
        """Close `[name]`; a character stuck to the name (`actor-0`) is called out as such."""
        pos = self.pos
        ch = self.text[pos] if pos < len(self.text) else ""
        if ch and ch not in _WS and ch not in "[]():+|":
            # AReaL's NAME has no '-' or '.': suggest '_' in its place.
            better = _NAME_RE.match(self.text.replace(ch, "_"), pos - len(name))
            self.fail(
                f"{ch!r} is not allowed in a name",
                pos,
                f"names hold letters, digits and '_': write {backend}[{better.group(0)}]:…",
            )
        self.expect("]", "expected ']' after the name", f"write {backend}[{name}]:…")

    def _check_fsdp(self, dims: dict[str, tuple[int, int]]) -> None:
        for letter, (size, pos) in dims.items():  # left to right
            if letter in _FSDP_ONLY_ONE and size > 1:
                self.fail(
                    f"fsdp does not take {_DIM_WORDS[letter]} parallelism ({letter}{size})",
                    pos,
                    f"fsdp takes d, t and c ({letter}1 is fine); "
                    "use megatron or archon for p and e",
                )

    def _ends_component(self, pos: int) -> bool:
        while pos < len(self.text) and self.text[pos] in _WS:
            pos += 1
        return pos == len(self.text) or self.text[pos] in "+|)"

    def moe(self, start: int, backend: str, name: str | None, name_pos: int) -> _Single:
        if backend not in ("megatron", "archon"):
            why = (
                "fsdp has no expert parallelism"
                if backend == "fsdp"
                else f"{backend} takes plain dimensions"
            )
            self.fail(
                f"the attn|ffn form is not for {backend}: {why}",
                self.pos,
                "use megatron:(attn:d2t2|ffn:e4) or archon:(…)",
            )
        open_pos = self.pos if self.skip_ws() == "(" else None
        if open_pos is not None:
            self.pos += 1
        self.keyword("attn")
        attn = self.dims("attn", _ATTN_DIMS)
        if self.skip_ws() != "|":
            self.fail(
                "expected '|ffn:' after the attn dimensions",
                self.pos,
                f"write {backend}:(attn:d2t2|ffn:e4)",
            )
        self.pos += 1
        self.skip_ws()
        ffn_pos = self.pos
        self.keyword("ffn")
        ffn = self.dims("ffn", _FFN_DIMS)
        if open_pos is not None:
            self.expect(
                ")",
                "expected ')' to close the '(' of the attn|ffn form",
                f"write {backend}:(attn:…|ffn:…)",
            )

        a = _filled(attn)
        world = a["d"] * a["t"] * a["p"] * a["c"]
        if "p" in ffn and ffn["p"][0] != a["p"]:
            self.fail(
                f"ffn p{ffn['p'][0]} differs from attn p{a['p']}",
                ffn["p"][1],
                "attention and experts share pipeline stages: give ffn the same p or omit it",
            )
        f_t = ffn.get("t", (1, 0))[0]
        f_e = ffn.get("e", (1, 0))[0]
        non_dp = f_t * a["p"] * f_e
        if "d" in ffn:
            f_d = ffn["d"][0]
            if f_d * non_dp != world:
                self.fail(
                    f"ffn world size {f_d * non_dp} (d·t·p·e) differs from attn world size "
                    f"{world} (d·t·p·c)",
                    ffn_pos,
                    "both parts run on the same GPUs; omit ffn d to derive it",
                )
        else:
            if world % non_dp:
                self.fail(
                    f"cannot derive ffn d: attn world size {world} is not divisible by "
                    f"ffn t·p·e = {non_dp}",
                    ffn_pos,
                    "pick ffn t and e whose product with p divides the attn world size",
                )
            f_d = world // non_dp
        dims = {**a, "e": f_e}
        return _Single(start, backend, name, name_pos, dims, FfnDims(f_d, f_t, a["p"], f_e))

    def keyword(self, word: str) -> None:
        self.skip_ws()
        if self.word_at(self.pos) != word:
            self.fail(f"expected '{word}:'", self.pos, "write megatron:(attn:d2t2|ffn:e4)")
        self.pos += len(word)
        self.expect(":", f"expected ':' after '{word}'", f"write {word}:d2")

    def dims(self, owner: str, allowed: str) -> dict[str, tuple[int, int]]:
        """Read `(letter N)+`; return letter -> (value, position of the letter)."""
        found: dict[str, tuple[int, int]] = {}
        while True:
            ch = self.skip_ws()
            if not ch.isascii() or not ch.isalpha():
                break
            letter_pos = self.pos
            word = self.word_at(letter_pos)
            self.pos += 1
            after = self.skip_ws()
            if not after.isdigit():
                self._fail_not_a_dim(owner, word, letter_pos, bool(found))
            self._check_letter(owner, allowed, ch, letter_pos)
            if ch in found:
                self.fail(
                    f"dimension {ch!r} given twice",
                    letter_pos,
                    f"write each of {'/'.join(allowed)} at most once",
                )
            found[ch] = (self.number(ch), letter_pos)
        if not found:
            where = f"{owner!r}" if owner in ("attn", "ffn") else f"'{owner}:'"
            self.fail(
                f"expected dimensions after {where}",
                self.pos,
                f"dimensions are letters {'/'.join(allowed)} with a size, e.g. d4t2",
            )
        return found

    def number(self, letter: str) -> int:
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos].isdigit():
            self.pos += 1
        digits = self.text[start : self.pos]
        if not digits.isascii():
            self.fail(f"bad size for {letter!r}", start, "sizes are written with digits 0-9")
        if digits.startswith("0"):
            bare = digits.lstrip("0")
            self.fail(
                f"size of {letter!r} must be a positive integer without leading zeros",
                start,
                f"write e.g. {letter}{bare}" if bare else f"write e.g. {letter}1",
            )
        value = int(digits[:8])
        if len(digits) > 7 or value > _MAX_DIM:
            self.fail(f"size of {letter!r} is too large", start, f"sizes go up to {_MAX_DIM}")
        return value

    def _check_letter(self, owner: str, allowed: str, letter: str, pos: int) -> None:
        if letter in allowed:
            return
        if letter not in DIMS:
            if letter == "m":
                hint = "AReaL's old 'm' (model parallel) is now 't' (tensor parallel)"
            elif letter.lower() in DIMS:
                hint = f"dimension letters are lowercase: {letter.lower()}"
            else:
                hint = "dimensions: " + ", ".join(f"{k} ({v})" for k, v in _DIM_WORDS.items())
            self.fail(f"unknown dimension {letter!r}", pos, hint)
        what = f"{_DIM_WORDS[letter]} parallelism ({letter})"
        if owner in inference_backends():
            self.fail(
                f"{owner} does not take {what}",
                pos,
                "inference servers take d (replicas), t (tensor) and p (pipeline)",
            )
        self.fail(
            f"the {owner} part does not take {what}",
            pos,
            "attn takes d, t, p, c; ffn takes d, t, p, e",
        )

    def _fail_not_a_dim(self, owner: str, word: str, pos: int, after_dims: bool) -> None:
        if after_dims and word in all_backends():
            self.fail(
                f"expected '+' or '|' before {word!r}",
                pos,
                "join components with '+' (separate GPUs) or '|' (shared GPUs)",
            )
        if after_dims and word == "ffn":
            self.fail("expected '|' before 'ffn'", pos, "write megatron:(attn:d2t2|ffn:e4)")
        letter = word[:1] or self.text[pos]
        if letter in DIMS:
            self.fail(f"expected a size after {letter!r}", pos + 1, f"write e.g. {letter}2")
        self._check_letter(owner, DIMS, letter, pos)
        self.fail(f"unexpected {letter!r}", pos)

    def _fail_bare_dims(self, start: int, dims_text: str) -> None:
        dims = re.sub(r"\s+", "", dims_text).replace("m", "t")
        pairs = re.findall(r"([a-z])([0-9]+)", dims)
        options = []
        if {k for k, _ in pairs} <= set("dtp"):
            options.append(f"sglang:{dims}")
        # fsdp is the usual trainer, and takes p and e as 1.
        if all(k in "dtc" or v == "1" for k, v in pairs):
            options.append(f"fsdp:{dims}")
        else:
            options.append(f"megatron:{dims}")
        self.fail(
            "missing backend: every component starts with one",
            start,
            "write " + " or ".join(options),
        )

    def _fail_legacy(self, dot: int) -> None:
        modern = _modernize(self.text)
        if modern is not None:
            self.fail(
                "this is the AReaL ≤0.3 spelling (backend.dims+dims)",
                dot,
                f"write {modern}",
            )
        self.fail(
            "expected ':' between backend and dimensions, not '.'",
            dot,
            "write backend:dims, e.g. sglang:d4t1+fsdp:d4",
        )

    # ---- rules across singles

    def validate(self, groups: list[list[_Single]]) -> Allocation:
        singles = [s for g in groups for s in g]
        seen: dict[str, _Single] = {}
        for s in singles:
            if s.name is None:
                continue
            if s.name in seen:
                self.fail(
                    f"name {s.name!r} is used twice",
                    s.name_pos,
                    "give every component its own name",
                )
            seen[s.name] = s
        for group in groups:
            if len(group) < 2:
                continue
            for s in group:
                if s.name is None:
                    self.fail(
                        "colocated components ('|') need names",
                        s.name_pos,
                        f"write {s.backend}[name]:…, e.g. sglang[rollout]:d4|fsdp[actor]:d4",
                    )
            anchor = group[0]
            for s in group[1:]:
                if s.world != anchor.world:
                    self.fail(
                        f"colocated components need equal world sizes: {anchor.name!r} has "
                        f"{anchor.world}, {s.name!r} has {s.world}",
                        s.start,
                        "'|' shares GPUs; use '+' to put them on separate GPUs",
                    )
        if len(singles) >= 3:
            for s in singles:
                if s.name is None:
                    self.fail(
                        f"with {len(singles)} components every one needs a name",
                        s.name_pos,
                        f"write {s.backend}[name]:…, e.g. "
                        "sglang[rollout]:d4+fsdp[actor]:d2+fsdp[critic]:d2",
                    )
        components = []
        for group in groups:
            anchor = group[0].name
            for i, s in enumerate(group):
                components.append(
                    Component(
                        name=s.name,
                        backend=s.backend,
                        d=s.dims["d"],
                        t=s.dims["t"],
                        p=s.dims["p"],
                        c=s.dims["c"],
                        e=s.dims["e"],
                        colocate_with=anchor if i else None,
                        ffn=s.ffn,
                    )
                )
        return Allocation(text=self.text, components=tuple(components))


def _filled(dims: dict[str, tuple[int, int]]) -> dict[str, int]:
    return {k: dims[k][0] if k in dims else 1 for k in DIMS}


# --------------------------------------------------------------------------- legacy

_LEGACY_PART = re.compile(
    r"\s*(?:(?P<backend>[a-z]+)\s*[.:]\s*)?(?P<dims>(?:[dtpcme]\s*[0-9]+\s*)+)|\s*(?P<eval>eval)\s*"
)


def _modernize(text: str) -> str | None:
    """The modern spelling of an AReaL ≤0.3 string (`sglang.d4p1t1+d4p1t1`), if it has one."""
    parts = text.split("+")
    out = []
    for i, part in enumerate(parts):
        m = _LEGACY_PART.fullmatch(part)
        if not m:
            return None
        if m.group("eval"):
            # `+eval` ran the servers for evaluation only: the inference part alone says that.
            if i == 0:
                return None
            continue
        backend = m.group("backend")
        if backend is not None and backend not in all_backends():
            return None
        if backend is None and i == 0:
            return None
        dims: dict[str, int] = {}
        for letter, num in re.findall(r"([a-z])\s*([0-9]+)", m.group("dims")):
            letter = "t" if letter == "m" else letter
            if letter in dims or num.startswith("0") or len(num) > 7:
                return None
            dims[letter] = int(num)
        full = {k: dims.get(k, 1) for k in DIMS}
        if backend in inference_backends():
            if full["c"] > 1 or full["e"] > 1:
                return None
            keep = "dt" + ("p" if full["p"] > 1 else "")
        else:
            # Legacy trainers were FSDP unless they needed pipeline or expert parallelism.
            if backend in (None, "fsdp"):
                backend = "fsdp" if full["p"] == 1 and full["e"] == 1 else "megatron"
            keep = "d" + "".join(k for k in "tpce" if full[k] > 1)
        out.append(f"{backend}:" + "".join(f"{k}{full[k]}" for k in keep))
    modern = "+".join(out)
    try:
        parse(modern)
    except AllocError:
        return None
    return modern
