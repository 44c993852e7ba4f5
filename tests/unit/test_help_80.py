"""Every help page at 80 columns: nothing wider, examples whole, prose wrapped only at the edge.

Each page is rendered by the real console script with COLUMNS=80 and compared with the
help text it came from: every line of an example block must come out as one line, and
every prose paragraph must come out complete, filled greedily (a line breaks only where
the next word would not fit), so a stray newline in the source cannot show.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from rich.text import Text

from areal_cli import cli

WIDTH = 80
AREAL = str(Path(sys.executable).parent / "areal")
PAGES = [
    [],
    ["serve"],
    ["train"],
    ["ps"],
    ["logs"],
    ["stop"],
    ["key"],
    ["alloc"],
    ["init-model"],
    ["doctor"],
    ["doctor", "hang"],
    ["doctor", "env"],
    ["doctor", "allreduce"],
    ["doctor", "check"],
    ["doctor", "mesh"],
]


def areal(*args: str, check: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": str(WIDTH), "NO_COLOR": "1"}
    res = subprocess.run([AREAL, *args], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == check, res.stderr
    return res


def command(path: list[str]):
    cmd = typer.main.get_command(cli.app)
    for name in path:
        cmd = cmd.commands[name]
    return cmd


def source_blocks(help_text: str) -> tuple[list[str], list[str]]:
    """(example lines, prose paragraphs) of a help text, as the reader should see them."""
    examples, prose = [], []
    for para in inspect.cleandoc(help_text).split("\n\n"):
        lines = para.split("\n")
        if lines[0].strip() == "\b":
            # A verbatim block is a heading and indented commands, never prose (which
            # would then not re-wrap).
            head, *body = lines[1:]
            assert head.endswith(":") and body, para
            assert all(line.startswith("  ") for line in body), para
            examples += [Text.from_markup(line).plain.rstrip() for line in body]
        else:
            prose.append(Text.from_markup(" ".join(line.strip() for line in lines)).plain)
    return examples, prose


def render(path: list[str]) -> list[str]:
    res = areal(*path, "--help", check=0)
    assert not res.stderr
    return res.stdout.splitlines()


def paragraphs(lines: list[str]) -> list[list[str]]:
    out, cur = [], []
    for line in lines:
        if line.strip():
            cur.append(line)
        elif cur:
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


@pytest.mark.parametrize("path", PAGES, ids=lambda p: " ".join(p) or "areal")
def test_help_page_fits_80_columns(path):
    lines = render(path)
    wide = [line for line in lines if len(line) > WIDTH]
    assert not wide, wide

    examples, prose = source_blocks(command(path).help)
    assert examples, "every page shows examples"
    for example in examples:
        assert example in lines, f"example broken or missing: {example!r}"

    rendered = paragraphs(lines)
    for para in prose:
        match = [p for p in rendered if " ".join(line.strip() for line in p) == para]
        assert match, f"paragraph re-wrapped wrongly or missing: {para!r}"
        for line, nxt in zip(match[0], match[0][1:], strict=False):
            first_word = nxt.split()[0]
            assert len(line) + 1 + len(first_word) > WIDTH, f"stray line break after {line!r}"


@pytest.mark.parametrize("path", PAGES, ids=lambda p: " ".join(p) or "areal")
def test_option_names_take_at_most_a_third_of_the_width(path):
    lines = render(path)
    start = lines.index("Options") + 1
    rows = lines[start:]
    for i, line in enumerate(rows):
        if not line.startswith("  "):
            break
        if line.startswith("  -"):
            _, _, help_ = line.strip().partition("  ")
            if not help_:  # a long name stands alone; its help starts the next line
                help_, line = rows[i + 1].strip(), rows[i + 1]
            assert help_.strip(), line
            assert line.index(help_.strip()) <= WIDTH // 3, line


def test_train_without_a_script_shows_the_same_page_on_stderr():
    """`areal train` alone is a usage error (exit 2) that shows the help page."""
    res = areal("train", check=2)
    lines = res.stderr.splitlines()
    assert lines[0] == "Usage: areal train [OPTIONS] SCRIPT [ARGS]..."
    assert lines == render(["train"])
    assert not [line for line in lines if len(line) > WIDTH]


def test_brackets_in_help_survive_the_markup():
    """`[server-N]` is text, not a style tag that the renderer would swallow."""
    text = "\n".join(render(["logs"]))
    assert "[server-N] / [rank-N]" in text
    assert "[server-N]" in "\n".join(render(["serve"]))
    assert "backend[name]:dims" in "\n".join(render(["alloc"]))
