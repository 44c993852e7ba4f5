"""May py-spy attach to the ranks? The kernel's and py-spy's answer before any dump, with the
exact fix when they will refuse: on this host (`doctor hang`) and on each node of a cluster
job (the node's sampler, diagnose.nodes).
"""

from __future__ import annotations

from dataclasses import replace

from areal_cli.diagnose import permissions, stacks
from areal_cli.errors import EXIT_FAILED, ArealError


class AttachError(ArealError):
    """py-spy may not or could not read the ranks: exit 1, with the fix as hint."""

    exit_code = EXIT_FAILED


def preflight(pids: list[int], pyspy: str) -> permissions.TracerInfo:
    """Raise AttachError with the exact fix when the kernel or py-spy will refuse."""
    return check(pids, permissions.tracer_info(stacks.pyspy_version(pyspy)))


def check(
    pids: list[int],
    tracer: permissions.TracerInfo | None = None,
    pyspy_version: tuple[int, ...] | None = None,
) -> permissions.TracerInfo:
    """`preflight` for `tracer` (None: this process's, py-spy's version not known yet); with
    `pyspy_version` (learnt later), only what that version adds: whether it is too old for the
    ranks' Python. The tracer, with the version."""
    if tracer is None:
        tracer = permissions.tracer_info(None)
    if pyspy_version is not None:
        tracer = replace(tracer, pyspy_version=pyspy_version)
        if permissions.pyspy_max_python(pyspy_version) is None:
            return tracer  # a release newer than the table: trusted
    old_pyspy = bool(
        tracer.pyspy_version and permissions.pyspy_max_python(tracer.pyspy_version) is not None
    )
    targets = [
        permissions.target_info(p, need_ancestry=tracer.ptrace_scope == 1, need_python=old_pyspy)
        for p in pids
    ]
    found = permissions.problems(tracer, targets)
    if found:
        first = found[0]
        detail = "\n".join(
            f"{p.message}" + (f" (pids {', '.join(map(str, p.pids[:8]))})" if p.pids else "")
            for p in found[1:]
        )
        raise AttachError(
            f"cannot attach to the ranks: {first.message}",
            hint=first.fix,
            detail=detail or None,
        )
    return tracer
