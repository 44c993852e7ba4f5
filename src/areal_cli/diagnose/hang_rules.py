"""The hang verdicts as a table: one row per kind, with its priority, what it means, and the
advice that goes with it (restart | stop | unknown, and why). diagnose.verdict holds each kind's
evidence (its judge, registered under the kind) and evaluates the rows in priority order: the
first judge that finds its evidence gives the verdict. A new kind is one row here and one judge
there (a unit test checks that every row has a judge and every judge a row).

`doctor hang --help` and docs/doctor.md list the kinds from this table, so this module imports
nothing: the help must not pay for the judging code.
"""

from __future__ import annotations


class Rule:
    __slots__ = ("kind", "priority", "hang", "needs_still", "advice", "why", "means")

    def __init__(
        self,
        kind: str,
        priority: int,
        means: str,
        advice: str,
        why: str,
        hang: bool = True,
        needs_still: bool = True,
    ) -> None:
        self.kind = kind
        self.priority = priority  # lower wins
        self.means = means
        self.advice = advice  # restart | stop | unknown
        self.why = why
        self.hang = hang
        # With several samples a hang is only called when something stood still: a row that
        # needs it is skipped when every rank moved.
        self.needs_still = needs_still


ADVICE = ("restart", "stop", "unknown")

RULES: tuple[Rule, ...] = (
    Rule(
        "missing_rank", 10,
        "a rank's process is gone and the others wait for it",
        "unknown", "it depends on why the rank ended: `areal doctor why` on its log says",
        needs_still=False,
    ),
    Rule(
        "stopped_rank", 20,
        "a rank's process is stopped (state T: SIGSTOP, Ctrl-Z); `kill -CONT PID` resumes it",
        "unknown", "continuing the stopped process resumes the job without a restart",
        needs_still=False,
    ),
    Rule(
        "progressing", 30,
        "some ranks moved while others waited (a slow rank is named)",
        "unknown", "not a hang (yet): run the doctor again if it stays",
        hang=False, needs_still=False,
    ),
    Rule(
        "shape_mismatch", 40,
        "(flight recorder) the ranks gave one collective of a group different sizes, and one "
        "still waits in it",
        "stop", "the code sizes the tensor differently per rank: a restart repeats it",
    ),
    Rule(
        "wrong_group", 50,
        "(flight recorder) ranks wait in collectives of different process groups, a member of "
        "one sitting in the other",
        "stop", "the code picks the group per rank: a restart repeats it",
    ),
    Rule(
        "straggler", 60,
        "some ranks compute in the same loop while the others wait",
        "unknown", "data-dependent work may or may not come back after a restart",
    ),
    Rule(
        "collective_type_mismatch", 70,
        "ranks wait in different collectives (or in different ops at one collective number)",
        "stop", "a rank-dependent branch in the code: a restart repeats it",
    ),
    Rule(
        "mismatched_collective", 80,
        "some ranks wait in a collective that others never joined",
        "stop", "a rank skipped the collective in the code: a restart repeats it",
    ),
    Rule(
        "p2p_cycle", 85,
        "every rank waits in a point-to-point send/recv: each waits for a peer that waits too",
        "stop", "the order of sends and receives is the code's: a restart repeats it",
    ),
    Rule(
        "collective_stuck", 90,
        "every rank here waits in the same collective (transport, or ranks on other hosts)",
        "restart", "a transport that stopped moving (a lost link, a wedged peer) may not "
        "come back by itself, and the code looks right",
    ),
    Rule(
        "no_hang", 95,
        "every rank moved, or no rank waits",
        "unknown", "not a hang: nothing to restart",
        hang=False, needs_still=False,
    ),
    Rule(
        "blocked_outside_collective", 100,
        "no rank is in a collective, every rank is blocked",
        "unknown", "a queue, lock, server or data loader: whether a restart helps depends on "
        "what it waits for",
    ),
)  # fmt: skip

BY_PRIORITY: tuple[Rule, ...] = tuple(sorted(RULES, key=lambda r: r.priority))
KINDS: tuple[str, ...] = tuple(r.kind for r in BY_PRIORITY)
HANGS = frozenset(r.kind for r in RULES if r.hang)
BY_KIND = {r.kind: r for r in RULES}


def help_text() -> str:
    """The kinds for `doctor hang --help`, in the order they are tried."""
    return ", ".join(KINDS)


def markdown() -> str:
    """The kinds as docs/doctor.md's table, in the order they are tried."""
    lines = ["| verdict | what it says | advice |", "|---|---|---|"]
    for r in BY_PRIORITY:
        lines.append(f"| `{r.kind}` | {r.means} | {r.advice}: {r.why} |")
    return "\n".join(lines)
