"""The core never names an engine: outside an engine's own code (backends/, and server/, the
reference engine's server) no string in src/ or commands/ is an engine's name. What differs
between engines is a feature the core asks the engine for (backends.Backend)."""

from __future__ import annotations

import ast
from pathlib import Path

from areal_cli import backends, plugins

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "areal_cli"
OWN = ("backends", "server")  # the engines' own code


def engine_names() -> set[str]:
    names = set(backends.names())
    for name in list(names):
        names.update(plugins.aliases(plugins.ENGINES, name))
    return names


def named(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every string constant of `source` that is an engine's name."""
    return [
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
    ]


def core_files() -> list[Path]:
    files = [p for p in SRC.rglob("*.py") if p.relative_to(SRC).parts[0] not in OWN]
    files += (REPO / "commands").rglob("*.py")
    return sorted(f for f in files if "__pycache__" not in f.parts)


def test_the_engines_are_found_by_their_entry_points():
    # The names the census below looks for: an empty set would let it pass on nothing.
    assert {"sglang", "vllm", "hf"} <= engine_names()


def test_the_census_sees_every_way_of_naming_an_engine():
    names = engine_names()
    source = (
        'if backend == "vllm": pass\n'
        'x = backend in ("hf", "other")\n'
        'y = {"sglang": 1}\n'
        'def f(backend="sglang"): return backend or "hf"\n'
    )
    assert sorted(named(source, names)) == [
        (1, "vllm"),
        (2, "hf"),
        (3, "sglang"),
        (4, "hf"),
        (4, "sglang"),
    ]


def test_no_file_outside_the_engines_names_one():
    names = engine_names()
    found = [
        f"{path.relative_to(REPO)}:{line}: {name!r}"
        for path in core_files()
        for line, name in named(path.read_text(), names)
    ]
    assert not found, "ask the engine for a feature instead:\n" + "\n".join(found)
