"""The manual builds, and no link in it or in the README leads nowhere.

mkdocs itself checks docs/ (mkdocs.yml's `validation` turns a missing page or anchor into a
warning, and --strict into a failure); the README lies outside docs/, so its links are
checked here against the files and the anchors mkdocs gives the headings.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[dev]')")
from markdown import Markdown  # noqa: E402  (mkdocs' own dependency)

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
README = REPO / "README.md"

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def links(md: Path) -> list[str]:
    """The link targets of a Markdown file, code blocks and code spans left out."""
    text = CODE_SPAN.sub("", FENCE.sub("", md.read_text()))
    return LINK.findall(text)


def anchors(md: Path) -> set[str]:
    """The ids mkdocs gives the headings of `md` (its toc extension, as mkdocs.yml sets it)."""
    converter = Markdown(extensions=["toc", "tables", "fenced_code"])
    html = converter.convert(md.read_text())
    return set(re.findall(r'<h[1-6] id="([^"]+)"', html))


def test_the_site_builds_in_strict_mode(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    pages = sorted(p.stem for p in DOCS.glob("*.md"))
    for page in pages:
        built = tmp_path / ("index.html" if page == "index" else f"{page}/index.html")
        assert built.is_file(), f"{page}.md was not built"


@pytest.mark.parametrize("md", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_every_relative_link_resolves(md):
    checked = 0
    for target in links(md):
        parts = urlsplit(target)
        if parts.scheme or parts.netloc:
            continue  # a web address: not this repository's to check
        path = md if not parts.path else (md.parent / unquote(parts.path)).resolve()
        assert path.exists(), f"{md.name}: {target} names no file"
        if parts.fragment:
            assert path.suffix == ".md", f"{md.name}: {target}: an anchor into a non-page"
            assert parts.fragment in anchors(path), f"{md.name}: {target}: no such heading"
        checked += 1
    if md in (README, DOCS / "index.md"):
        assert checked >= 5, f"{md.name} should link to the manual's pages"


def test_the_readme_is_a_front_page_and_the_manual_has_pages():
    assert len(README.read_text().splitlines()) <= 300
    pages = list(DOCS.glob("*.md"))
    assert len(pages) >= 5
    text = (REPO / "mkdocs.yml").read_text()
    for page in pages:  # every page is in the navigation, so a reader can reach it
        assert f" {page.name}" in text, f"{page.name} is not in mkdocs.yml's nav"
