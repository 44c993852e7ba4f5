"""`areal doctor why --log` on logs from the field: each `tests/fixtures/why/<name>.log` is a
log pasted into a public issue, saved as the issue shows it, and `<name>.yaml` beside it says
where it comes from and what the answer must be (kind, rank when the log tells it, the root
cause's exception or signal, file:line when the log has it, and the advice).

`python tests/unit/test_doctor_why_corpus.py` prints the score, kinds × launchers."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "tests" / "fixtures" / "why"
CASES = sorted(p.stem for p in CORPUS.glob("*.yaml"))


def expected(name: str) -> dict:
    return yaml.safe_load((CORPUS / f"{name}.yaml").read_text())


def misses(name: str, out: dict) -> list[str]:
    """What the report (doctor why --json) gets wrong for one case; empty when right."""
    want = expected(name)["expected"]
    root = out.get("root_cause") or {}
    got = []
    if root.get("kind") != want["kind"]:
        got.append(f"kind {root.get('kind')!r}, wanted {want['kind']!r}")
    if want["rank"] is not None and root.get("rank") != want["rank"]:
        got.append(f"rank {root.get('rank')!r}, wanted {want['rank']!r}")
    if want["root"].lower() not in (root.get("message") or "").lower():
        got.append(f"root {root.get('message')!r}, wanted one that says {want['root']!r}")
    if want["where"] and not (root.get("where") or "").endswith(want["where"]):
        got.append(f"where {root.get('where')!r}, wanted …{want['where']}")
    advice = (out.get("advice") or {}).get("action")
    if advice != want["advice"]:
        got.append(f"advice {advice!r}, wanted {want['advice']!r}")
    return got


def test_the_corpus_is_large_and_wide_enough():
    cases = [expected(n) for n in CASES]
    assert len(cases) >= 40
    assert len({c["project"] for c in cases}) >= 12
    assert all(c["source"].startswith("https://github.com/") for c in cases)
    assert all((CORPUS / f"{n}.log").is_file() for n in CASES)


@pytest.mark.parametrize("name", CASES)
def test_doctor_why_names_the_root_cause_of_a_field_log(name):
    from tests.helpers import areal

    res = areal("doctor", "why", "--log", str(CORPUS / f"{name}.log"), "--json")
    assert res.returncode in (0, 1), res.stderr
    assert not misses(name, json.loads(res.stdout)), misses(name, json.loads(res.stdout))


def score() -> tuple[int, int, dict, list]:
    """(right, total, {(kind, launcher): [right, total]}, misses) in this process: the same
    verdict as the CLI's, without a kernel record (a foreign log's pids are not this host's)."""
    from areal_cli.diagnose import why

    right, table, missed = 0, defaultdict(lambda: [0, 0]), []
    for name in CASES:
        case = expected(name)
        rep = why.analyze(why.parse_files([(f"{name}.log", CORPUS / f"{name}.log")]))
        bad = misses(name, rep.to_json())
        cell = table[(case["expected"]["kind"], case["launcher"])]
        cell[1] += 1
        if bad:
            missed.append((name, bad))
        else:
            right += 1
            cell[0] += 1
    return right, len(CASES), dict(table), missed


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "src"))
    right, total, table, missed = score()
    kinds = sorted({k for k, _ in table})
    launchers = sorted({launcher for _, launcher in table})
    print(f"{right}/{total} right ({100 * right / total:.0f} %)\n")
    print("| kind | " + " | ".join(launchers) + " |")
    print("|---|" + "---|" * len(launchers))
    for k in kinds:
        cells = [f"{table[(k, la)][0]}/{table[(k, la)][1]}" if (k, la) in table else ""
                 for la in launchers]  # fmt: skip
        print(f"| {k} | " + " | ".join(cells) + " |")
    for name, bad in missed:
        print(f"\nmiss {name}: " + "; ".join(bad))
