"""The README and the manual in docs/: the README stays a front door, every relative link leads
to a file (and, with an anchor, to a heading of it), the docs state rules rather than history,
and the license is there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS]

#: A Markdown link or image: [text](target) (targets without spaces; an optional "title").
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~)")

#: History words: session or issue numbers ("session 5", "sessions 4 and 5", "issue 17").
_HISTORY = re.compile(r"\b(?:sessions? \d|issues? #?\d+|fourth session|this machine|used to)\b", re.I)


def _prose(path: Path) -> str:
    """The page without its fenced code blocks (commands and log samples are not prose)."""
    out, fenced = [], False
    for line in path.read_text().splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return "\n".join(out)


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a page: lower case, punctuation dropped, spaces to -."""
    anchors = set()
    for line in _prose(path).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            text = re.sub(r"[^\w\- ]", "", m.group(1).lower().replace("`", ""))
            anchors.add(text.replace(" ", "-"))
    return anchors


def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) < 210, f"README.md has {len(lines)} lines: move detail into docs/"


def test_license_exists():
    text = (REPO / "LICENSE").read_text()
    assert text.startswith("MIT License") and "checkpoint-sidecar authors" in text


def test_the_link_checker_sees_links():
    """Not vacuous: the README links to the manual, and anchors are found."""
    targets = _LINK.findall(README.read_text())
    assert "docs/CONFIGURATION.md" in targets and any("#" in t for t in targets)
    assert "the-shutdown-budget" in _anchors(REPO / "docs" / "DEPLOY.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path):
    broken = []
    for target in _LINK.findall(_prose(page)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_history_words(page: Path):
    """The docs state the rule, not how it came to be: no session or issue numbers, no "used
    to". Real uses such as "agent session", "per-session" or FOUNDRY_AGENT_SESSION_ID do not
    match; measurements and their history belong in bench/RESULTS.md."""
    found = [(n, m.group(0)) for n, line in enumerate(page.read_text().splitlines(), 1)
             for m in _HISTORY.finditer(line)]
    assert not found, f"{page.relative_to(REPO)}: " + ", ".join(f"line {n}: {w!r}" for n, w in found)


def test_history_pattern_allows_real_uses():
    real = "an agent session; per-session namespaces; FOUNDRY_AGENT_SESSION_ID=s1; SESSION_ID=session-2; two sessions"
    assert not _HISTORY.search(real)
    for history in ("fixed in session 5", "sessions 4 and 5", "issue 17", "Issue #7", "it used to"):
        assert _HISTORY.search(history), history
