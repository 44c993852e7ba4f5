"""Can py-spy attach to these processes? Answered before dumping, with the exact fix.

Linux lets a process read another one's memory (ptrace, process_vm_readv) when
`ptrace_may_access` agrees:

- Yama (`kernel.yama.ptrace_scope`): 0 same-user processes; 1 only descendants, unless the
  tracer has CAP_SYS_PTRACE; 2 only CAP_SYS_PTRACE; 3 nobody, and it cannot be lowered until
  reboot.
- Without CAP_SYS_PTRACE the target must run as the same user, and its permitted capabilities
  must be a subset of the tracer's. This is why root in a container started without
  `--cap-add SYS_PTRACE` cannot attach to other root processes that kept more capabilities.
- py-spy reads interpreter structs by layout, so each py-spy release knows Python versions up
  to some release and no further.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

CAP_SYS_PTRACE = 19

# Newest CPython minor each py-spy release can read (from py-spy's changelog).
PYSPY_MAX_PYTHON: tuple[tuple[tuple[int, ...], tuple[int, int]], ...] = (
    ((0, 3, 11), (3, 10)),
    ((0, 3, 14), (3, 11)),
    ((0, 4, 0), (3, 13)),
)

SUDO_RERUN = 'sudo env "PATH=$PATH" areal doctor hang ...'


@dataclass(frozen=True)
class Problem:
    kind: str  # ptrace_scope | no_cap_sys_ptrace | other_user | pyspy_version
    message: str
    fix: str
    pids: tuple[int, ...] = ()


@dataclass(frozen=True)
class TargetInfo:
    pid: int
    uid: int | None
    cap_permitted: int | None
    python: tuple[int, int] | None
    is_descendant: bool


@dataclass(frozen=True)
class TracerInfo:
    euid: int
    cap_effective: int
    ptrace_scope: int | None  # None: no Yama
    in_container: bool
    pyspy_version: tuple[int, ...] | None


def problems(tracer: TracerInfo, targets: list[TargetInfo]) -> list[Problem]:
    """Everything that will stop py-spy from reading these targets (pure: no system calls).
    The rules are tables: Yama's first (one refusal there is the whole answer: the kernel
    checks it before anything else), then the others, each adding what it finds."""
    for rule in _YAMA_RULES:
        found = rule(tracer, targets)
        if found is not None:
            return [found]
    return [p for rule in _RULES if (p := rule(tracer, targets)) is not None]


def _has_cap(tracer: TracerInfo) -> bool:
    return bool(tracer.cap_effective >> CAP_SYS_PTRACE & 1)


def _scope_3(tracer: TracerInfo, targets: list[TargetInfo]) -> Problem | None:
    if tracer.ptrace_scope != 3:
        return None
    return Problem(
        "ptrace_scope",
        "kernel.yama.ptrace_scope is 3: ptrace is disabled for everyone on this host",
        "3 cannot be lowered while the system runs: set kernel.yama.ptrace_scope = 0 in "
        "/etc/sysctl.d/10-ptrace.conf and reboot",
    )


def _scope_2(tracer: TracerInfo, targets: list[TargetInfo]) -> Problem | None:
    if tracer.ptrace_scope != 2 or _has_cap(tracer):
        return None
    return Problem(
        "ptrace_scope",
        "kernel.yama.ptrace_scope is 2: only processes with CAP_SYS_PTRACE may attach",
        f"run as root: {SUDO_RERUN}  (or: sudo sysctl -w kernel.yama.ptrace_scope=0)",
    )


def _scope_1(tracer: TracerInfo, targets: list[TargetInfo]) -> Problem | None:
    if tracer.ptrace_scope != 1 or _has_cap(tracer):
        return None
    outside = tuple(t.pid for t in targets if not t.is_descendant)
    if not outside:
        return None
    return Problem(
        "ptrace_scope",
        "kernel.yama.ptrace_scope is 1: only a process's ancestors may attach to "
        "it, and these ranks were not started by this command",
        "sudo sysctl -w kernel.yama.ptrace_scope=0 (keep it with "
        "'kernel.yama.ptrace_scope = 0' in /etc/sysctl.d/10-ptrace.conf), "
        f"or run as root: {SUDO_RERUN}",
        outside,
    )


def _other_user(tracer: TracerInfo, targets: list[TargetInfo]) -> Problem | None:
    if _has_cap(tracer):
        return None
    other = tuple(t.pid for t in targets if t.uid is not None and t.uid != tracer.euid)
    if not other:
        return None
    return Problem(
        "other_user",
        "these processes belong to another user, and attaching to them needs CAP_SYS_PTRACE",
        f"run as their user, or as root: {SUDO_RERUN}",
        other,
    )


def _stronger(tracer: TracerInfo, targets: list[TargetInfo]) -> Problem | None:
    """Same-user targets whose permitted capabilities are not a subset of the tracer's."""
    if _has_cap(tracer):
        return None
    stronger = tuple(
        t.pid
        for t in targets
        if t.uid == tracer.euid
        and t.cap_permitted is not None
        and t.cap_permitted & ~tracer.cap_effective
    )
    if not stronger:
        return None
    if tracer.in_container or tracer.euid == 0:
        fix = (
            "start the container with CAP_SYS_PTRACE: docker run --cap-add SYS_PTRACE "
            '(Kubernetes: securityContext.capabilities.add: ["SYS_PTRACE"]), or run '
            "`areal doctor hang` from the host"
        )
    else:
        fix = f"run as root: {SUDO_RERUN}"
    return Problem(
        "no_cap_sys_ptrace",
        "this process lacks CAP_SYS_PTRACE and the targets hold capabilities it "
        "does not, so the kernel refuses to let it read them",
        fix,
        stronger,
    )


def _pyspy_too_old(tracer: TracerInfo, targets: list[TargetInfo]) -> Problem | None:
    if tracer.pyspy_version is None:
        return None
    ceiling = pyspy_max_python(tracer.pyspy_version)
    too_new = tuple(
        t.pid for t in targets if t.python is not None and ceiling and t.python > ceiling
    )
    if not too_new:
        return None
    py = max(t.python for t in targets if t.python is not None)
    return Problem(
        "pyspy_version",
        f"py-spy {'.'.join(map(str, tracer.pyspy_version))} cannot read Python "
        f"{py[0]}.{py[1]} (it knows up to {ceiling[0]}.{ceiling[1]})",
        "upgrade py-spy in the environment areal runs from: pip install -U py-spy",
        too_new,
    )


# Each rule: the Problem it finds, or None.
_YAMA_RULES = (_scope_3, _scope_2, _scope_1)
_RULES = (_other_user, _stronger, _pyspy_too_old)


def pyspy_max_python(version: tuple[int, ...]) -> tuple[int, int] | None:
    """The newest Python a py-spy release reads; None for releases newer than the table (trusted:
    a failing dump is still explained afterwards)."""
    if version > PYSPY_MAX_PYTHON[-1][0]:
        return None
    ceiling = (3, 9)
    for release, py in PYSPY_MAX_PYTHON:
        if version >= release:
            ceiling = py
    return ceiling


def explain_failure(kind: str, tracer: TracerInfo) -> str:
    """The fix to print when py-spy failed with `kind` although the preflight saw no problem."""
    if kind == "permission":
        if tracer.in_container:
            return (
                "inside a container, py-spy needs CAP_SYS_PTRACE: docker run --cap-add "
                'SYS_PTRACE (Kubernetes: securityContext.capabilities.add: ["SYS_PTRACE"])'
            )
        return f"run as root: {SUDO_RERUN}"
    if kind == "version":
        return "upgrade py-spy: pip install -U py-spy"
    if kind == "timeout":
        return "raise --timeout; a process stopped in the kernel (D state) cannot be read at all"
    if kind == "not_python":
        return "the process has not started Python yet, or is not a Python program"
    if kind == "namespace":
        return "install util-linux (nsenter, unshare), or leave out --native"
    return "run py-spy dump --pid PID by hand to see its full message"


# --------------------------------------------------------------------------- system facts


def tracer_info(pyspy_version: tuple[int, ...] | None) -> TracerInfo:
    return TracerInfo(
        euid=os.geteuid(),
        cap_effective=_caps(_read(Path("/proc/self/status")), "CapEff") or 0,
        ptrace_scope=read_ptrace_scope(),
        in_container=in_container(),
        pyspy_version=pyspy_version,
    )


def target_info(pid: int, need_ancestry: bool = True, need_python: bool = True) -> TargetInfo:
    """What the kernel and py-spy will look at; the slower facts only when a check needs them
    (ancestry under ptrace_scope 1, the Python version for a py-spy older than it)."""
    status = Path(f"/proc/{pid}/status")
    try:
        text = status.read_text()
    except OSError:
        text = ""
    return TargetInfo(
        pid=pid,
        uid=_uid(text),
        cap_permitted=_caps(text, "CapPrm"),
        python=python_version_of(pid) if need_python else None,
        is_descendant=_is_descendant(pid) if need_ancestry else False,
    )


def read_ptrace_scope() -> int | None:
    try:
        return int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip())
    except (OSError, ValueError):
        return None


def in_container() -> bool:
    if Path("/.dockerenv").exists() or Path("/run/.containerenv").exists():
        return True
    try:
        cgroup = Path("/proc/1/cgroup").read_text()
    except OSError:
        return False
    return any(k in cgroup for k in ("docker", "kubepods", "containerd", "libpod", "lxc"))


_PY_RE = re.compile(r"(?:libpython|/python)(3)\.(\d+)")


def python_version_of(pid: int) -> tuple[int, int] | None:
    """CPython minor version of a process, from the files it maps (no attaching needed)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                m = _PY_RE.search(line)
                if m:
                    return int(m.group(1)), int(m.group(2))
    except OSError:
        pass
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None
    m = _PY_RE.search(exe)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _caps(status: str, field: str) -> int | None:
    try:
        for line in status.splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1], 16)
    except (ValueError, IndexError):
        return None
    return None


def _uid(status: str) -> int | None:
    try:
        for line in status.splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[2])  # effective uid
    except (ValueError, IndexError):
        return None
    return None


def _is_descendant(pid: int) -> bool:
    me = os.getpid()
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                text = f.read()
            pid = int(text[text.rindex(b")") + 2 :].split()[1])  # the parent's pid
        except (OSError, ValueError, IndexError):
            return False
        if pid == me:
            return True
    return False
