"""Record classes for the modules `areal ps` imports, without `dataclasses`.

`dataclasses` imports `inspect` (and with it ast, dis and tokenize): about 10 ms, most of what
`areal ps --json` costs beyond a bare interpreter, paid by every script that polls it. A
record here names its fields in `__slots__` (a subclass names only those it adds) and writes
its own `__init__`; `Plain` gives it what a dataclass would: equality, a repr and `to_json()`,
the same dict `dataclasses.asdict` made, so the JSON files written from it do not change.
"""

from __future__ import annotations


class Plain:
    """Equality, repr and `to_json()` over the fields in the `__slots__` of a class and of
    its bases (bases' first, as a dataclass orders them). Unhashable, as a dataclass is
    unless frozen: a frozen one defines `__hash__` over `values()`."""

    __slots__ = ()
    _fields: tuple[str, ...] = ()

    def __init_subclass__(cls, **kw) -> None:
        super().__init_subclass__(**kw)
        slots = cls.__dict__.get("__slots__", ())
        cls._fields = (*cls._fields, *((slots,) if isinstance(slots, str) else slots))

    def values(self) -> tuple:
        return tuple(getattr(self, f) for f in self._fields)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self.values() == other.values()

    def __repr__(self) -> str:
        fields = ", ".join(f"{f}={getattr(self, f)!r}" for f in self._fields)
        return f"{type(self).__qualname__}({fields})"

    def to_json(self) -> dict:
        """The fields as a dict, nested records, lists and dicts copied (dataclasses.asdict)."""
        return plain(self)


def plain(value):
    """`value` with records turned into dicts of their fields and containers copied, as
    `dataclasses.asdict` does (a nested record's own `to_json` is not asked, nor there)."""
    if isinstance(value, Plain):
        return {f: plain(getattr(value, f)) for f in value._fields}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    return value


class Frozen(Plain):
    """A record whose fields are set once, by its `__init__` (with `object.__setattr__`), as
    a frozen dataclass's: hashable, so a dict key or a set member."""

    __slots__ = ()

    def _freeze(self, *values) -> None:
        """Set the fields, in their order (what the record's `__init__` calls)."""
        for field, value in zip(self._fields, values, strict=True):
            object.__setattr__(self, field, value)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"cannot assign to field {name!r} of a {type(self).__name__}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete field {name!r} of a {type(self).__name__}")

    def __hash__(self) -> int:
        return hash(self.values())

    def __reduce__(self):
        # Pickled by its fields (Ray sends handles to its actors): the default would restore
        # them by setattr, which a frozen record refuses.
        return type(self), self.values()
