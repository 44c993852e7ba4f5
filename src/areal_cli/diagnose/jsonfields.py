"""A diagnosis record's JSON: the fields it names, in that order (the order `--json` prints),
a nested record by its own `to_json`, a tuple or list item by item. One helper, so that a
record's `to_json` is the list of what it says rather than a dict spelled out field by field.
"""

from __future__ import annotations


def json_fields(record, names: str) -> dict:
    """{name: value} of `record`'s fields named in `names` (space-separated)."""
    return {name: _json_value(getattr(record, name)) for name in names.split()}


def _json_value(value):
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return value
