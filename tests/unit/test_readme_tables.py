"""The manual's tables of the doctor's kinds (docs/doctor.md) are the code's tables: a kind
added to a table (hang_rules, why_kinds) without its row in the manual fails here."""

from __future__ import annotations

from pathlib import Path

from areal_cli.diagnose import hang_rules, why_kinds

DOCTOR_PAGE = (Path(__file__).resolve().parents[2] / "docs" / "doctor.md").read_text()


def test_the_hang_verdicts_table_is_hang_rules_own():
    assert hang_rules.markdown().strip() in DOCTOR_PAGE


def test_every_root_cause_kind_has_its_row_with_its_advice():
    rows = [line for line in DOCTOR_PAGE.splitlines() if line.startswith("| `")]
    for kind in why_kinds.KINDS:
        if kind.tier == "secondary":  # consequences: listed together, never a root's advice
            continue
        (row,) = [r for r in rows if f"`{kind.name}`" in r.split("|")[1]]
        advice = row.split("|")[2].strip()
        assert advice == kind.advice or advice == "by sender", (kind.name, advice, kind.advice)
