"""The user docs hold together: every relative link and anchor of README.md and docs/*.md
resolves inside the repository, and the README stays short and free of history.

Anchors follow GitHub's rule for headings: lower case, punctuation other than ``-`` and
``_`` dropped, spaces turned into ``-``, and ``-1``, ``-2``... added to repeated ones.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 450

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"`[^`]*`")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a link inside one is an example, not a link)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a Markdown file's headings give, with GitHub's suffixes for repeats."""
    seen: Counter[str] = Counter()
    found = set()
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if match:
            base = slug(match.group(2))
            found.add(f"{base}-{seen[base]}" if seen[base] else base)
            seen[base] += 1
    return found


def links(path: Path) -> list[str]:
    """The targets of a Markdown file's inline links, code spans and blocks left out."""
    targets = []
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        targets += _LINK.findall(_CODE_SPAN.sub("", line))
    return targets


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """The links of ``path`` that name no file under ``root``, or no heading of one."""
    broken = []
    for target in links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists() or not resolved.is_relative_to(root):
            broken.append(f"{target} (no such file in the repository)")
        elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
            broken.append(f"{target} (no such heading in {resolved.relative_to(root)})")
    return broken


def test_the_slug_follows_githubs_rule() -> None:
    assert slug("Soak a fleet: `broker-lookup soak --engines N`") == (
        "soak-a-fleet-broker-lookup-soak---engines-n"
    )
    en_dash = "\u2013"  # punctuation GitHub drops
    assert slug(f"LMCache 0.5.6 (D1{en_dash}D26)") == "lmcache-056-d1d26"
    assert slug("LMCache / vLLM") == "lmcache--vllm"


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "a.md").write_text("# Top\n\n## Part two\n")
    (tmp_path / "elsewhere.md").write_text("# Elsewhere\n")
    page = repo / "docs" / "b.md"
    page.write_text(
        "[ok](../a.md#part-two) [ok](#here) [gone](missing.md) [bad](../a.md#part-three)\n"
        "[out](../../elsewhere.md) [web](https://example.com/x.md)\n"
        "`[code](missing.md)`\n```\n[block](missing.md)\n```\n# Here\n"
    )
    assert broken_links(page, root=repo) == [
        "missing.md (no such file in the repository)",
        "../a.md#part-three (no such heading in a.md)",
        "../../elsewhere.md (no such file in the repository)",
    ]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path) -> None:
    assert not broken_links(path)


def test_the_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < README_MAX_LINES


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_docs_point_at_nothing_outside_the_repository(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert "../shared" not in text
    assert not re.findall(r"\bDESIGN rule\b", text)
    assert not re.findall(r"\b[0-9a-f]{40}\b", text)


def test_the_readme_is_no_lab_notebook() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert not re.findall(r"\bstop \d+", text, flags=re.I)
    assert not re.findall(r"\bissue #?\d+", text, flags=re.I)
