"""The kinds of failure `areal doctor why` tells apart, as one table: a row per kind with its
evidence (patterns over an exception's text, or where its events come from), its tier (how it
ranks against the others when the root cause is chosen) and the advice it carries (restart,
stop or unknown, with the reason), which the restart work decides by.

A new kind is one row (and a test): `classify` walks the rows in order, the first whose
evidence matches wins; `--help` and docs/doctor.md list the kinds from this table.

Tiers, strongest first:
- primary: the failure itself (an exception, an OOM, a crash);
- weak: a launcher's word that a process ended (an exit code, a signal, a dead Ray worker),
  root only when no rank says more;
- secondary: what peers suffer after the first failure (timeouts, lost connections,
  torchrun's ChildFailedError), root only when nothing else is there.
A stop from outside (areal stop, Slurm, the watchdog) outranks all of them (why.analyze).
"""

from __future__ import annotations

import re
import signal as _signal
from collections.abc import Sequence
from dataclasses import dataclass

RESTART, STOP, UNKNOWN = "restart", "stop", "unknown"


@dataclass(frozen=True)
class Kind:
    name: str
    tier: str  # primary | weak | secondary
    advice: str  # restart | stop | unknown
    reason: str  # why that advice, in words a user acts on
    doc: str  # what the kind is (for --help and docs/doctor.md)
    evidence: str = ""  # regex over an exception's text (case-insensitive); "" = set by a rule
    collective: bool = False  # the evidence counts only for torch.distributed's own errors
    # The restart column (areal train --max-restarts): an infrastructure fault that a restart
    # may cure, and why. Where the advice is restart or stop it is the advice; an unknown's
    # own answer is here, and a repeat at the same place stops the restarts anyway.
    restart: bool = False
    restart_reason: str = ""


_ONLY_CONSEQUENCE = (
    "only a consequence is in these logs; the failure that caused it is not: read the "
    "other ranks' or nodes' logs"
)

KINDS: tuple[Kind, ...] = (
    Kind(
        "cuda_oom",
        "primary",
        STOP,
        "the same step needs the same GPU memory again: lower the memory use first",
        "a rank ran out of GPU memory",
        r"cuda out of memory|cuda error: out of memory|cuda_error_out_of_memory"
        r"|outofmemoryerror.*\bcuda\b",
    ),
    Kind(
        "oom_killer",
        "primary",
        RESTART,
        "the host's memory ran out and a process was killed for it: a restart may pass, "
        "watch the host's memory",
        "the kernel's OOM killer (or Ray's memory monitor) killed a process",
        r"running low on memory|killed due to memory pressure|out of memory: killed process",
        restart=True,
    ),
    Kind(
        "cpu_oom",
        "primary",
        STOP,
        "the same step needs the same host memory again: lower the memory use first",
        "a rank ran out of host memory (MemoryError)",
        r"(?-i:\bMemoryError\b)|can't allocate memory",
    ),
    Kind(
        "collective_mismatch",
        "primary",
        STOP,
        "the ranks' code disagrees on a collective: a restart reaches the same mismatch",
        "ranks called different collectives, or with different sizes",
        r"received data size doesn't match|detected mismatch between collectives"
        r"|collective mismatch|collective_fingerprint",
    ),
    Kind(
        "child_failed",
        "secondary",
        UNKNOWN,
        _ONLY_CONSEQUENCE,
        "torchrun's (or a launcher's) report that a child failed",
        r"childfailederror",
    ),
    Kind(
        "launcher_failed",
        "secondary",
        UNKNOWN,
        _ONLY_CONSEQUENCE,
        "AReaL's launcher reporting a failed job (JobException)",
        r"(?-i:\bJobException\b)",
    ),
    Kind(
        "signal",
        "weak",
        UNKNOWN,
        "a signal from outside ended the process: who sent it decides",
        "a signal ended a rank or the job (and who sent it)",
        r"signalexception|got signal: \d+|\bkeyboardinterrupt\b",
        restart=True,
        restart_reason="a signal from outside the job (the OOM killer, a node's or a scheduler's "
        "stop): the fault is the host's, not the code's",
    ),
    Kind(
        "process_died",
        "weak",
        UNKNOWN,
        "a worker process died without a Python error: the OOM killer, a native crash or a "
        "forced stop; the node's kernel log (dmesg) tells which",
        "a Ray actor or a server's worker died without a Python error",
        r"actordiederror|actor died unexpectedly|worker process has died"
        r"|worker died or was killed|died unexpectedly|worker unexpectedly exits",
        restart=True,
        restart_reason="a worker died without a Python error: the node or its memory, not the code",
    ),
    Kind(
        "cuda_error",
        "primary",
        UNKNOWN,
        "a CUDA fault: a bug in a kernel repeats on restart, a faulty GPU (Xid in dmesg) does not",
        "a CUDA error: an illegal memory access, a device-side assert",
        r"illegal memory access|device-side assert|unhandled cuda error|cuda error"
        r"|acceleratorerror|misaligned address",
        restart=True,
        restart_reason="a faulty GPU passes with a restart; a kernel bug repeats at the same "
        "place and stops the restarts there",
    ),
    Kind(
        "collective_timeout",
        "secondary",
        RESTART,
        "a collective timed out: a lost peer or a network fault passes with a restart, a "
        "hang in the code does not (areal doctor hang)",
        "a collective timed out (NCCL's watchdog, gloo)",
        r"timed out|timeout|watchdog caught",
        collective=True,
        restart=True,
    ),
    Kind(
        "connection_lost",
        "secondary",
        RESTART,
        "a connection between ranks or to a server was lost: it passes with a restart",
        "a peer's connection closed or failed (NCCL system error, a socket)",
        r"connection (closed|reset)|broken pipe|remote process exited|ncclremoteerror"
        r"|connection refused|socket closed|peer closed|end of file|remotedisconnected"
        r"|unhandled system error|ncclsystemerror",
        restart=True,
    ),
    Kind(
        "nccl_error",
        "primary",
        UNKNOWN,
        "NCCL failed otherwise: its settings (NCCL_*, interfaces) fail again, a fabric fault "
        "may not",
        "an NCCL error that is neither a timeout nor a lost connection",
        r"\bnccl error\b|ncclinvalid|ncclinternalerror|distbackenderror",
        restart=True,
        restart_reason="a fabric fault passes with a restart; wrong NCCL settings repeat at the "
        "same place and stop the restarts there",
    ),
    Kind(
        "config_error",
        "primary",
        STOP,
        "the command line or the configuration is wrong: a restart fails the same way",
        "a script rejected its arguments or configuration",
        r"^[\w.-]+\.py: error: ",
    ),
    Kind(
        "native_abort",
        "primary",
        UNKNOWN,
        "a native abort (SIGABRT, C++ terminate): an assertion in a library repeats, a fault "
        "of the node does not",
        "a rank aborted in native code",
    ),
    Kind(
        "exit_code",
        "weak",
        UNKNOWN,
        "a process exited with an error code, and its own error is not in these logs: "
        "read that rank's log",
        "a launcher's word that a rank exited with an error code",
    ),
    Kind(
        "server_died",
        "primary",
        RESTART,
        "a server of the job exited: a restart brings it back",
        "a server of the job exited",
        restart=True,
    ),
    Kind(
        "hang",
        "primary",
        RESTART,
        "the job stopped progressing: a restart resumes from the last checkpoint, a "
        "deadlock in the code repeats (the watchdog's verdict says which)",
        "the watchdog ended a job that stopped progressing",
        restart=True,
    ),
    Kind(
        "python_exception",
        "primary",
        STOP,
        "a Python exception in the job's code or its configuration: a restart raises it again",
        "a Python exception (with your file:line)",
    ),
    Kind(
        "teardown_warning",
        "secondary",
        UNKNOWN,
        _ONLY_CONSEQUENCE,
        "ProcessGroupNCCL's warning at exit",
    ),
    Kind(
        "stopped_by_launcher",
        "secondary",
        UNKNOWN,
        _ONLY_CONSEQUENCE,
        "Slurm ending a step's other tasks once one failed",
    ),
    Kind(
        "server_error",
        "secondary",
        UNKNOWN,
        _ONLY_CONSEQUENCE,
        "a traceback a server logged while it lived on",
    ),
)

BY_NAME = {k.name: k for k in KINDS}
SECONDARY_KINDS = tuple(k.name for k in KINDS if k.tier == "secondary")
WEAK_KINDS = tuple(k.name for k in KINDS if k.tier == "weak")
_EVIDENCE = [(k, re.compile(k.evidence, re.I | re.M)) for k in KINDS if k.evidence]


def classify(messages: Sequence[str], frames: Sequence[tuple[str, int, str]] = ()) -> str:
    """The kind of an exception from its message(s) (a chain: every link counts)."""
    text = "\n".join(messages)
    for kind, rx in _EVIDENCE:
        if rx.search(text) and (not kind.collective or _collective(text.lower(), frames)):
            return kind.name
    if re.search(r"timed out|timeout", text, re.I) and "distributed" in text.lower():
        return "collective_timeout"
    return "python_exception"


def _collective(low: str, frames) -> bool:
    """torch.distributed's own error: raised in its frames or naming its backends."""
    return (
        any("distributed" in f[0] or "c10d" in f[0] for f in frames)
        or "gloo" in low
        or "nccl" in low
        or "distbackenderror" in low
        or "diststoreerror" in low
        or "worknccl" in low
    )


# Who stops a job from outside on purpose, and who ends it for reasons a restart outlives.
_STOPPED = ("areal stop", "Slurm cancel", "Ctrl-C", "SIGTERM to areal", "Slurm time limit",
            "Slurm deadline")  # fmt: skip
_LOST = ("Slurm preemption", "Slurm node failure", "the cluster", "Slurm (the node")


def advice(kind: str, sender: str | None = None, exit_code: int | None = None) -> dict:
    """{action, reason} for a root cause of `kind` (a signal's by its sender and number)."""
    row = BY_NAME.get(kind)
    if row is None:
        return {"action": UNKNOWN, "reason": "not a kind this table knows"}
    if kind == "signal":
        if sender and sender.startswith(_STOPPED):
            return {"action": STOP, "reason": f"stopped on purpose from outside ({sender})"}
        if sender and sender.startswith(_LOST):
            return {"action": RESTART, "reason": f"the job lost its nodes ({sender})"}
        sig = -exit_code if exit_code and exit_code < 0 else None
        if sig == _signal.SIGSEGV:
            return {"action": UNKNOWN, "reason": "a native crash (SIGSEGV): a library bug "
                    "repeats on restart, a faulty node does not"}  # fmt: skip
        if sig == _signal.SIGKILL:
            return {"action": UNKNOWN, "reason": "SIGKILL from outside the job: the OOM killer "
                    "(dmesg on that node names the pid) or a person or scheduler"}  # fmt: skip
    return {"action": row.advice, "reason": row.reason}


def restart_verdict(
    kind: str | None, sender: str | None = None, exit_code: int | None = None
) -> tuple[bool, str]:
    """(restart or not, why) for a root cause of `kind` under `--restart-on infra`: the advice
    where it is restart or stop, the kind's restart column where the advice is unknown."""
    if kind is None:
        return False, "the logs name no failure: nothing says a restart would pass"
    a = advice(kind, sender, exit_code)
    if a["action"] != UNKNOWN:
        return a["action"] == RESTART, a["reason"]
    row = BY_NAME.get(kind)
    if row is not None and row.restart:
        return True, row.restart_reason or a["reason"]
    return False, f"not known to be a fault of the infrastructure: {a['reason']}"


def kinds_help() -> str:
    """The kinds, one a line with their advice: for `doctor why --help` and docs/doctor.md."""
    width = max(len(k.name) for k in KINDS)
    return "\n".join(f"  {k.name:<{width}}  {k.advice:<7}  {k.doc}" for k in KINDS)
