"""A trial's log files by role: server-N.log, rank-N.log, torchrun.log, supervisor-*.log."""

from __future__ import annotations

import re
from pathlib import Path

from areal_cli.errors import UsageError

ROLES = ("server", "rank", "torchrun", "supervisor")
_NAME = re.compile(r"^(server|rank)-(\d+)\.log$")


def select_logs(
    log_dir: Path, role: str | None = None, index: int | None = None
) -> dict[str, Path]:
    """label → path, ordered servers, ranks, then torchrun and supervisor."""
    if role is not None and role not in ROLES:
        raise UsageError(f"unknown role {role!r}", hint="roles: " + ", ".join(ROLES))
    found: list[tuple[int, int, str, Path]] = []
    if log_dir.is_dir():
        for p in log_dir.iterdir():
            m = _NAME.match(p.name)
            if m:
                found.append(
                    (ROLES.index(m.group(1)), int(m.group(2)), f"{m.group(1)}-{m.group(2)}", p)
                )
            elif p.name == "torchrun.log":
                found.append((ROLES.index("torchrun"), 0, "torchrun", p))
            elif p.name.startswith("supervisor") and p.suffix == ".log":
                found.append((ROLES.index("supervisor"), 0, p.stem, p))
    out = {}
    for r, i, label, path in sorted(found):
        if role is not None and ROLES[r] != role:
            continue
        if index is not None and (ROLES[r] not in ("server", "rank") or i != index):
            continue
        out[label] = path
    return out
