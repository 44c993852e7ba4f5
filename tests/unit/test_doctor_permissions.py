"""Attach permission problems are found before dumping, each with its exact fix."""

from __future__ import annotations

from areal_cli.diagnose.permissions import (
    CAP_SYS_PTRACE,
    Problem,
    TargetInfo,
    TracerInfo,
    explain_failure,
    problems,
    pyspy_max_python,
)

ALL_CAPS = (1 << 41) - 1
NO_PTRACE = ALL_CAPS & ~(1 << CAP_SYS_PTRACE)


def tracer(euid=1000, caps=0, scope=0, container=False, pyspy=(0, 4, 3)) -> TracerInfo:
    return TracerInfo(euid, caps, scope, container, pyspy)


def target(pid=10, uid=1000, caps=0, python=(3, 11), descendant=False) -> TargetInfo:
    return TargetInfo(pid, uid, caps, python, descendant)


def kinds(found: list[Problem]) -> list[str]:
    return [p.kind for p in found]


def test_plain_user_same_uid_scope_0_is_fine():
    assert problems(tracer(), [target()]) == []


def test_scope_3_cannot_be_fixed_without_reboot():
    found = problems(tracer(euid=0, caps=ALL_CAPS, scope=3), [target(uid=0)])
    assert kinds(found) == ["ptrace_scope"]
    assert "reboot" in found[0].fix


def test_scope_2_needs_cap_sys_ptrace():
    found = problems(tracer(scope=2), [target()])
    assert kinds(found) == ["ptrace_scope"]
    assert "sudo" in found[0].fix
    assert problems(tracer(euid=0, caps=ALL_CAPS, scope=2), [target(uid=0)]) == []


def test_scope_1_allows_descendants_only():
    found = problems(tracer(scope=1), [target(pid=5), target(pid=6, descendant=True)])
    assert kinds(found) == ["ptrace_scope"]
    assert found[0].pids == (5,)
    assert "sudo sysctl -w kernel.yama.ptrace_scope=0" in found[0].fix
    assert problems(tracer(scope=1), [target(descendant=True)]) == []


def test_other_users_processes_need_the_capability():
    found = problems(tracer(), [target(uid=1001)])
    assert kinds(found) == ["other_user"]


def test_root_in_a_container_without_sys_ptrace():
    found = problems(
        tracer(euid=0, caps=NO_PTRACE & ~(1 << 24), container=True), [target(uid=0, caps=ALL_CAPS)]
    )
    assert kinds(found) == ["no_cap_sys_ptrace"]
    assert "--cap-add SYS_PTRACE" in found[0].fix
    assert "SYS_PTRACE" in found[0].fix


def test_pyspy_too_old_for_the_target_python():
    found = problems(tracer(pyspy=(0, 3, 14)), [target(python=(3, 12))])
    assert kinds(found) == ["pyspy_version"]
    assert "pip install -U py-spy" in found[0].fix
    assert pyspy_max_python((0, 3, 14)) == (3, 11)
    assert pyspy_max_python((0, 4, 0)) == (3, 13)
    assert pyspy_max_python((0, 9, 0)) is None  # newer than we know: trusted


def test_failures_after_the_fact_are_explained():
    assert "SYS_PTRACE" in explain_failure("permission", tracer(container=True))
    assert "sudo" in explain_failure("permission", tracer())
    assert "py-spy" in explain_failure("version", tracer())
