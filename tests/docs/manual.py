"""Read the manual's code blocks and compare what a command printed with what the manual shows.

Blocks come from README.md and docs/*.md through markdown-it (the parser rich brings), so a
fence inside a list item, an indented code block and a fence's language are read as a
renderer reads them. A block's markers are HTML comments on the lines just above it:

    <!-- not run: REASON -->      never executed; the reason is required
    <!-- fragment -->             python: compiled only (not a whole program)
    <!-- file: PATH -->           the block's text is written to PATH in the page's sandbox
                                  (checked as its language says, then used by later blocks)
    <!-- needs: slurm|etcd|ray --> run with that service up (skips, or fails with
                                  AREAL_REQUIRE_SLURM=1 etc., when it is missing)

Output is compared by shape: ANSI colours, absolute paths, numbers (and a size's unit), hex ids, runs of one box-drawing
character and whitespace are normalised on both sides; a line `...` in the manual stands for
any number of lines, and `...` inside a line for any text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from markdown_it import MarkdownIt

REPO = Path(__file__).resolve().parents[2]

# Languages and what the harness does with them.
SHELL = {"console", "bash", "sh", "shell"}
RUN = SHELL | {"python", "yaml", "yml", "json"}
# Text is a file's contents or a printout the manual quotes: there is nothing to execute.
INERT = {"text"}
MARKER = re.compile(r"^\s*<!--\s*(not run|fragment|file|needs)\s*(?::\s*(.*?))?\s*-->\s*$")


@dataclass
class Block:
    page: str  # path relative to the repo, e.g. "docs/serve.md"
    line: int  # 1-based line of the opening fence
    lang: str  # "" for an indented block or a fence without a language
    text: str
    markers: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def pages(repo: Path = REPO) -> list[Path]:
    docs = sorted((repo / "docs").glob("*.md")) if (repo / "docs").is_dir() else []
    return [repo / "README.md", *docs]


def read_blocks(path: Path, repo: Path = REPO) -> list[Block]:
    """Every fenced or indented code block of one page, with the markers above it."""
    source = path.read_text()
    lines = source.splitlines()
    page = str(path.relative_to(repo)) if path.is_relative_to(repo) else path.name
    blocks = []
    for tok in MarkdownIt("commonmark").parse(source):
        if tok.type not in ("fence", "code_block") or tok.map is None:
            continue
        lang = tok.info.split()[0].lower() if tok.type == "fence" and tok.info.strip() else ""
        blocks.append(Block(page, tok.map[0] + 1, lang, tok.content, _markers(lines, tok.map[0])))
    return blocks


def _markers(lines: list[str], start: int) -> dict[str, str]:
    """Marker comments on the lines just above line `start` (0-based), blank lines between
    them allowed, nearest first wins."""
    found: dict[str, str] = {}
    i = start - 1
    while i >= 0:
        line = lines[i]
        if not line.strip():
            i -= 1
            continue
        m = MARKER.match(line)
        if not m:
            break
        found.setdefault(m.group(1), (m.group(2) or "").strip())
        i -= 1
    return found


def problem(block: Block) -> str | None:
    """Why this block cannot be checked as it stands (None when it can)."""
    if "not run" in block.markers:
        if not block.markers["not run"]:
            return "`<!-- not run: REASON -->` needs a reason"
        return None
    if block.lang in INERT:
        return None
    if not block.lang:
        return (
            "a code block without a language is neither run nor marked: fence it as console,"
            " bash, python, yaml or text, or mark it <!-- not run: REASON -->"
        )
    if block.lang not in RUN:
        return f"the harness cannot run {block.lang!r} blocks: mark it <!-- not run: REASON -->"
    if "fragment" in block.markers and block.lang != "python":
        return "only python blocks can be fragments"
    if "file" in block.markers and not block.markers["file"]:
        return "`<!-- file: PATH -->` needs a path"
    if block.lang == "console" and not console_steps(block.text):
        return "a console block needs `$ ` before each command"
    return None


@dataclass
class Step:
    command: str
    expected: list[str]


def console_steps(text: str) -> list[Step]:
    """`$ command` lines (a trailing backslash continues one) and the output after each."""
    steps: list[Step] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith("$ "):
            if steps:
                steps[-1].expected.append(line)
            elif line.strip():
                return []  # output before any command: not a shell session
            i += 1
            continue
        cmd = [line[2:]]
        while cmd[-1].endswith("\\") and i + 1 < len(lines):
            i += 1
            cmd.append(lines[i])
        steps.append(Step("\n".join(cmd), []))
        i += 1
    return steps


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
# An absolute path not inside a URL (http://host/...) or a word.
PATH = re.compile(r"(?<![\w:/.~-])/[\w.@+-]+(?:/[\w.@+*-]*)*")
# A number, with its sign (a loss prints -0.0000 as well as +0.0000).
NUMBER = re.compile(r"(?:(?<![\w-])[+-])?\d+(?:[.,]\d+)*")
# A hex id (a job marker, a Ray job id): letters and digits, at least one digit.
HEX = re.compile(r"(?<![\w])(?=[0-9a-f]*\d)[0-9a-f]{6,}(?![\w])")
# A size's unit follows its magnitude (634.7 MiB, 2.7 GiB).
SIZE = re.compile(r"\b0( ?)[KMGTP]i?B\b")
# One box-drawing or block-element character repeated: a table's rule or a bar whose length
# follows the data.
RULE = re.compile(r"([\u2500-\u259f])\1+")
SPACE = re.compile(r"\s+")


def normalise(line: str) -> str:
    line = ANSI.sub("", line)
    line = PATH.sub("/PATH", line)
    line = HEX.sub("0", line)
    line = NUMBER.sub("0", line)
    line = SIZE.sub(r"0\1B", line)
    line = RULE.sub(r"\1", line)
    return SPACE.sub(" ", line).strip()


def _pattern(expected: str) -> re.Pattern:
    parts = [re.escape(p) for p in normalise(expected).split("...")]
    return re.compile(".*".join(parts) + r"\Z")


def mismatch(expected: list[str], actual: str) -> str | None:
    """None when `actual` has the shape of the manual's `expected` lines, else a description
    of the first line that differs."""
    want = [e for e in expected if e.strip()]
    got = [n for n in (normalise(a) for a in actual.splitlines()) if n]
    pats = [None if w.strip() == "..." else _pattern(w) for w in want]
    # ok[i][j]: the manual's lines from i on match the real lines from j on.
    ok = [[False] * (len(got) + 1) for _ in range(len(pats) + 1)]
    ok[len(pats)][len(got)] = True
    for i in range(len(pats) - 1, -1, -1):
        for j in range(len(got), -1, -1):
            if pats[i] is None:
                ok[i][j] = ok[i + 1][j] or (j < len(got) and ok[i][j + 1])
            else:
                ok[i][j] = j < len(got) and bool(pats[i].match(got[j])) and ok[i + 1][j + 1]
    if ok[0][0]:
        return None
    # Name the first manual line that a greedy walk cannot place.
    j, free, bad, near = 0, False, "(its end)", ""
    for i, pat in enumerate(pats):
        if pat is None:
            free = True
            continue
        stop = len(got) if free else min(j + 1, len(got))
        hits = [k for k in range(j, stop) if pat.match(got[k])]
        if not hits:
            bad = want[i]
            break
        j, free = hits[0] + 1, False
    near = f"real line {got[j]!r}" if j < len(got) else "the end of the real output"
    tail = "\n".join(ANSI.sub("", actual).splitlines()[-40:])
    return f"the manual's line {bad!r} does not match {near}\n--- real output (tail) ---\n{tail}"
