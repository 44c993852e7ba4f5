"""The core never names a scheduler or a registry: no file outside a plug-in's own module
compares a string to a scheduler's name or a registry's scheme; it asks the plug-in (a method
or a declared attribute) instead. The names are read from the entry points, so a plug-in
added later is covered too."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from areal_cli import plugins
from tests.helpers import REPO

SRC = REPO / "src" / "areal_cli"
PREFIX_CALLS = {"startswith", "endswith", "removeprefix", "removesuffix", "partition", "find"}


def _names(group: str) -> set[str]:
    return {a for n in plugins.names(group) for a in plugins.aliases(group, n)}


def _own(group: str) -> list[Path]:
    """Each plug-in's own code: the module its entry point names, or all of its package."""
    out = []
    for name in plugins.names(group):
        module = plugins.target(group, name).partition(":")[0]
        origin = Path(importlib.util.find_spec(module).origin).resolve()
        out.append(origin.parent if origin.name == "__init__.py" else origin)
    return out


def _core_files(group: str) -> list[Path]:
    files = [p.resolve() for p in (*SRC.rglob("*.py"), *(REPO / "commands").rglob("*.py"))]
    own = _own(group)
    return [f for f in files if not any(f == o or o in f.parents for o in own)]


def _strings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):  # `x in ("a", "b")`
        return [e.value for e in node.elts if isinstance(e, ast.Constant)
                and isinstance(e.value, str)]  # fmt: skip
    return []


def _uses(tree: ast.AST, names: set[str], schemes: bool) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        said: list[str] = []
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                said += _strings(operand)
        elif isinstance(node, ast.MatchValue):
            said += _strings(node.value)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in PREFIX_CALLS and node.args):  # fmt: skip
            said += [s.partition("://")[0] for s in _strings(node.args[0]) if "://" in s]
        for s in said:
            if s in names or (schemes and s.partition("://")[0] in names and "://" in s):
                found.append((node.lineno, ast.unparse(node)[:100]))
    return found


def _census(group: str, schemes: bool) -> list[str]:
    names = _names(group)
    assert names, f"no plug-in of {group} is installed"
    out = []
    for f in _core_files(group):
        for line, text in _uses(ast.parse(f.read_text(), str(f)), names, schemes):
            out.append(f"{f}:{line}: {text}")
    return out


def test_no_core_file_compares_a_string_to_a_scheduler_name():
    assert _census(plugins.SCHEDULERS, schemes=False) == []


def test_no_file_outside_a_registry_compares_a_string_to_its_scheme():
    assert _census(plugins.REGISTRIES, schemes=True) == []


def test_the_census_sees_each_way_of_naming_one():
    # What the census must catch, each written as the core once did.
    names = {"local", "slurm", "ray", "etcd"}
    for code in ('x == "slurm"', 'x in ("local", "slurm")', '"ray" not in sys.modules',
                 'url.startswith("etcd://")', 'match x:\n    case "slurm":\n        pass'):  # fmt: skip
        assert _uses(ast.parse(code), names, schemes=True), code
    assert _uses(ast.parse('x == "slurmd"'), names, schemes=True) == []
