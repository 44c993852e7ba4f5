"""Plug-ins: engines, schedulers and registries, each found by name through Python entry
points, as TorchX finds its schedulers.

    cls = plugins.load(plugins.SCHEDULERS, "slurm")   # the class, its module imported now
    plugins.names(plugins.REGISTRIES)                 # ["file", "etcd", ...]

A distribution declares its plug-ins in its metadata (pyproject.toml):

    [project.entry-points."areal_cli.schedulers"]
    k8s = "mypkg.k8s:K8sScheduler"
    kube = "mypkg.k8s:K8sScheduler"      # a second name for the same target: an alias

Installed (or a `NAME-VERSION.dist-info/entry_points.txt` on sys.path), it is seen by every
command in every shell. Names of one target in one distribution are aliases of each other
(the object itself says which it calls itself, e.g. a scheduler's `name`). When two
distributions declare one name, the first on sys.path wins and loading it says so in one
warning line.

Start-up: `importlib.metadata` costs about 40 ms to import, more than all of `areal ps`, so
the entry points are read here from the distributions' own `entry_points.txt` files by its
rules (sys.path order, one distribution per normalized name), once per process. A name that
this reading does not find is looked up again through `importlib.metadata` itself (zipped
and custom-finder distributions included) before it is called unknown.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from functools import cache, lru_cache

from areal_cli.errors import ArealError, ArealWarning, UsageError

ENGINES = "areal_cli.engines"
SCHEDULERS = "areal_cli.schedulers"
REGISTRIES = "areal_cli.registries"

# How messages name a plug-in of each group.
NOUNS = {ENGINES: "backend", SCHEDULERS: "scheduler", REGISTRIES: "registry scheme"}
_PREFIX = "areal_cli."

# What a plug-in adds when its library makes the interpreter's own exit slow (Ray's client
# threads and exit hooks take a second and more): each is called once the command is done,
# ends what it must, and says True to have the CLI leave at once (os._exit), the output
# flushed.
exit_hooks: list[Callable[[], bool]] = []


class Entry:
    """One entry point. A plain class: `dataclasses` imports `inspect`, about 10 ms of the
    start-up of `areal ps`."""

    __slots__ = ("name", "value", "dist")

    def __init__(self, name: str, value: str, dist: str):
        self.name = name
        self.value = value  # "module:attr"
        self.dist = dist  # the distribution that declares it, as its folder names it

    @property
    def where(self) -> str:
        return f"{self.name} = {self.value} of {self.dist}"


def _normalize(dist: str) -> str:
    return re.sub(r"[-_.]+", "_", dist).lower()


def _parse(text: str) -> dict[str, list[tuple[str, str]]]:
    """entry_points.txt: INI sections of `name = value` lines; only our groups are kept."""
    groups: dict[str, list[tuple[str, str]]] = {}
    section = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip()
            continue
        if section is None or not section.startswith(_PREFIX) or "=" not in line:
            continue
        name, _, value = line.partition("=")
        groups.setdefault(section, []).append((name.strip(), value.strip()))
    return groups


def _add(found: dict[str, dict[str, list[Entry]]], dist: str, groups) -> None:
    for group, pairs in groups.items():
        for name, value in pairs:
            found.setdefault(group, {}).setdefault(name, []).append(Entry(name, value, dist))


@lru_cache(maxsize=1)
def _scan() -> dict[str, dict[str, list[Entry]]]:
    """group -> name -> its declarations, the winning one first."""
    found: dict[str, dict[str, list[Entry]]] = {}
    seen: set[str] = set()
    for path in sys.path:
        try:
            listing = os.scandir(path or ".")
        except OSError:  # a zip, a missing folder: importlib.metadata's turn on a miss
            continue
        with listing:
            for item in listing:
                for suffix in (".dist-info", ".egg-info"):
                    if item.name.endswith(suffix):
                        break
                else:
                    continue
                dist = item.name[: -len(suffix)]
                key = _normalize(dist.partition("-")[0])
                if key in seen:
                    continue
                seen.add(key)
                try:
                    with open(os.path.join(item.path, "entry_points.txt"), encoding="utf-8") as f:
                        text = f.read()
                except (OSError, UnicodeDecodeError):
                    continue
                _add(found, dist, _parse(text))
    return found


@cache
def _full(group: str) -> dict[str, list[Entry]]:
    """The group as importlib.metadata sees it (every kind of distribution)."""
    from importlib import metadata

    found: dict[str, dict[str, list[Entry]]] = {}
    for ep in metadata.entry_points(group=group):
        dist = ep.dist
        label = f"{dist.name}-{dist.version}" if dist is not None else "?"
        _add(found, label, {group: [(ep.name, ep.value)]})
    return found.get(group, {})


def refresh() -> None:
    """Forget what was read (a distribution installed since, in this process)."""
    _scan.cache_clear()
    _full.cache_clear()


def _entries(group: str) -> dict[str, list[Entry]]:
    return _scan().get(group, {})


def check(group: str, name: str) -> None:
    """Raise the UsageError load() would for a name no plug-in of the group has."""
    _find(group, name)


def _find(group: str, name: str) -> list[Entry]:
    found = _entries(group).get(name)
    if not found:
        found = _full(group).get(name)
    if not found:
        raise UsageError(f"unknown {noun(group)} {name!r}", hint="choose one of: " + listing(group))
    return found


def noun(group: str) -> str:
    return NOUNS.get(group, f"plug-in of {group}")


def _targets(found: dict[str, list[Entry]]) -> dict[tuple[str, str], list[str]]:
    """(distribution, target) -> its names, in the order the metadata lists them."""
    out: dict[tuple[str, str], list[str]] = {}
    for name, (entry, *_) in found.items():
        out.setdefault((entry.dist, entry.value), []).append(name)
    return out


def names(group: str) -> list[str]:
    """One name of each plug-in of the group (its aliases left out)."""
    return [ns[0] for ns in _targets(_entries(group)).values()]


def aliases(group: str, name: str) -> list[str]:
    """Every name of the plug-in `name` names, `name` first."""
    for ns in _targets(_entries(group)).values():
        if name in ns:
            return [name, *(n for n in ns if n != name)]
    return [name]


def listing(group: str) -> str:
    """The names for a message: `a, b or bee, c`."""
    found = _targets({**_full(group), **_entries(group)})
    return ", ".join(" or ".join(ns) for ns in found.values()) or "none is installed"


def target(group: str, name: str) -> str:
    """The `module:attr` that plug-in `name` of `group` names (not imported)."""
    return _find(group, name)[0].value


def load(group: str, name: str, base: type | None = None):
    """The object plug-in `name` of `group` names, its module imported now. With `base`: it
    must be a subclass of `base`. Anything wrong is one UsageError naming the entry."""
    import importlib
    import warnings

    entry, *others = _find(group, name)
    what = f"{noun(group)} {name!r} (entry point {entry.where})"
    module, _, attr = entry.value.partition(":")
    hint = f"reinstall {entry.dist.partition('-')[0]}, or check that its module imports here"
    try:
        obj = importlib.import_module(module.strip())
        for part in filter(None, attr.strip().split(".")):
            obj = getattr(obj, part)
    except ArealError:
        raise
    except Exception as e:  # a plug-in's module may raise anything while it imports
        raise UsageError(
            f"{what}: cannot load {entry.value} ({type(e).__name__}: {e})", hint=hint
        ) from None
    if base is not None and not (isinstance(obj, type) and issubclass(obj, base)):
        raise UsageError(
            f"{what}: {entry.value} is not a {noun(group)} class",
            hint=f"an entry point of {group} names a subclass of "
            f"{base.__module__}.{base.__qualname__}",
        )
    replaced = [o for o in others if o.value != entry.value]
    if replaced:
        # Legitimate (a site's own local scheduler), but a job that behaves unlike the one
        # it replaces must not leave the user guessing why.
        warnings.warn(
            f"{noun(group)} {name!r}: {entry.dist}'s {entry.value} replaces "
            + ", ".join(f"{o.dist}'s {o.value}" for o in replaced),
            ArealWarning,
            stacklevel=2,
        )
    return obj
