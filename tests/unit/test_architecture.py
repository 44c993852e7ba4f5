"""The import rules of the house, read from the source with `ast` (every import counts, the ones
inside function bodies too, since a lazy import is still a dependency):

- the layers: a module imports only from its own layer or the ones below it, so data flows one
  way (flags -> spec -> plan -> processes -> registry) and the core never reaches up into the
  commands, the schedulers or the doctor;
- no import cycles between modules;
- only the CLI (cli.py, _app.py, commands/) imports typer (that the doctor imports no
  scheduler is tests/unit/test_doctor_no_scheduler.py);
- most imports sit at the top of a file, where a reader sees them (lazy ones are kept for the
  start-up of `ps` and for heavy third-party modules, which this census does not count);
- no function longer than 80 lines.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from functools import cache
from pathlib import Path

from tests.helpers import REPO

SRC = REPO / "src" / "areal_cli"
COMMANDS = REPO / "commands"

# Lowest first. A module may import from its own layer and the layers before it. The first
# matching prefix decides (so "schedulers.api" can sit below "schedulers").
LAYERS: list[tuple[str, ...]] = [
    # the core: data and small services every part uses
    (
        "",
        "errors",
        "plain",
        "files",
        "settings",
        "console",
        "procs",
        "logfiles",
        "gpus",
        "health",
        "apikeys",
        "models",
        "modelgen",
        "plugins",
        "parallel",
        "alloc",
    ),
    # plug-in contracts and the data a job is made of
    ("backends", "registry", "request_errors", "schedulers.api", "discovery", "control", "spec"),
    # what runs on a node: the reference server, launchers, the trainer's runtime
    ("server", "launchers", "worker", "areal_entry"),
    # the doctor works on a job record and a way to reach nodes, never on a scheduler
    ("diagnose",),
    # schedulers place, run and observe jobs; they may use the doctor (watchdog, why)
    ("schedulers",),
    # flags and YAML become a JobSpec (with the doctor's presets and limits checked)
    ("jobspec",),
    # the CLI
    ("commands", "cli", "_app", "__main__"),
]
CLI = ("commands", "cli", "_app")


def _module_name(path: Path) -> str:
    if COMMANDS in path.parents:
        rel, prefix = path.relative_to(COMMANDS), ["commands"]
    else:
        rel, prefix = path.relative_to(SRC), []
    parts = [p for p in rel.with_suffix("").parts if p != "__init__"]
    return ".".join(prefix + parts)


@cache
def _files() -> dict[str, Path]:
    out = {}
    for base in (SRC, COMMANDS):
        for p in base.rglob("*.py"):
            rel = p.relative_to(base).parts
            if "__pycache__" in rel or (base == SRC and rel[0] in ("commands", "templates")):
                continue  # commands/ and templates/ are symlinks into src/
            out[_module_name(p)] = p
    return out


def _resolve(name: str) -> str | None:
    files = _files()
    name = name.removeprefix("areal_cli.").removeprefix("areal_cli")
    while name and name not in files:
        name = name.rpartition(".")[0]
    return name or None


@cache
def _imports() -> dict[str, list[tuple[str, int, bool]]]:
    """module -> [(imported module, line, inside a function)] for areal_cli imports, and
    ("<ext>:" + top-level package, ...) for third-party ones."""
    out: dict[str, list[tuple[str, int, bool]]] = defaultdict(list)
    for mod, path in _files().items():
        tree = ast.parse(path.read_text(), str(path))

        def visit(node: ast.AST, in_func: bool, mod=mod) -> None:
            for ch in ast.iter_child_nodes(node):
                inner = in_func or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef))
                if isinstance(ch, ast.If) and "TYPE_CHECKING" in ast.unparse(ch.test):
                    continue  # annotations only: not a dependency at run time
                names: list[str] = []
                if isinstance(ch, ast.Import):
                    names = [a.name for a in ch.names]
                elif isinstance(ch, ast.ImportFrom) and ch.module and ch.level == 0:
                    names = [f"{ch.module}.{a.name}" for a in ch.names]
                for n in names:
                    if n == "areal_cli" or n.startswith("areal_cli."):
                        target = _resolve(n)
                        if target is not None and target != mod:
                            out[mod].append((target, ch.lineno, in_func))
                    else:
                        out[mod].append(("<ext>:" + n.partition(".")[0], ch.lineno, in_func))
                visit(ch, inner)

        visit(tree, False)
    return out


def _layer(mod: str) -> int:
    for i, prefixes in enumerate(LAYERS):
        if any(mod == p or (p and mod.startswith(p + ".")) for p in prefixes):
            return i
    raise AssertionError(f"{mod} is in no layer: add it to LAYERS")


def _where(mod: str, line: int) -> str:
    return f"{_files()[mod].relative_to(REPO)}:{line}"


def test_every_module_has_a_layer():
    for mod in _files():
        _layer(mod)


def test_no_module_imports_from_a_layer_above_it():
    bad = [f"{_where(m, line)}: {m} imports {t}"
           for m, found in _imports().items() for t, line, _ in found
           if not t.startswith("<ext>:") and _layer(t) > _layer(m)]  # fmt: skip
    assert bad == []


def test_no_import_cycles():
    graph = {m: {t for t, _, _ in found if not t.startswith("<ext>:")}
             for m, found in _imports().items()}  # fmt: skip
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(_files()):
        if v not in index:
            connect(v)
    assert cycles == []


def test_only_the_cli_imports_typer():
    bad = [f"{_where(m, line)}: {m}" for m, found in _imports().items()
           for t, line, _ in found if t in ("<ext>:typer", "<ext>:click")
           and not any(m == c or m.startswith(c + ".") for c in CLI)]  # fmt: skip
    assert bad == []


def test_most_imports_sit_at_the_top():
    ours = [inside for found in _imports().values() for t, _, inside in found
            if not t.startswith("<ext>:")]  # fmt: skip
    share = sum(ours) / len(ours)
    assert share <= 0.25, f"{share:.0%} of {len(ours)} areal_cli imports are inside functions"


def test_no_function_over_80_lines():
    long = []
    for mod, path in _files().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    long.append(f"{_where(mod, node.lineno)} {node.name}: {n} lines")
    assert long == []
