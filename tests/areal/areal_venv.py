"""AReaL's own venv for the `areal` tier (scripts/areal-venv.sh, `make areal`)."""

from __future__ import annotations

import os
from pathlib import Path

REQUIRE = "AREAL_REQUIRE_AREAL"
STAMP = ".areal-venv"  # written by scripts/areal-venv.sh once the venv is built and imports


def areal_python() -> str:
    root = os.environ.get("AREAL_ENGINES") or "/var/cache/areal-engines"
    return str(Path(root) / "areal" / "bin" / "python")


def missing() -> str | None:
    """Why AReaL's venv cannot run here, or None."""
    py = Path(areal_python())
    if not py.exists() or not (py.parent.parent / STAMP).exists():
        return f"AReaL's venv is not built in {py.parent.parent} (run `make areal`)"
    return None
