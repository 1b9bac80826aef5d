"""The README is the front door (at most 250 lines) and every relative link in it and in docs/ resolves.

A link resolves when its file (or folder) exists inside the repository and, for ``file.md#anchor`` or ``#anchor``, the
markdown file has a heading whose GitHub anchor is ``anchor`` (GitHub's slug: lower case, punctuation other than ``-``
and ``_`` dropped, spaces to ``-``, a repeated heading suffixed ``-1``, ``-2``, ...). Links inside code (fenced blocks,
inline spans) are text, not links.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

pytestmark = pytest.mark.dev

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
DEV_LANE = 'pytest -m "not slow and not engine"'

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:[^>]*\s)?(?:id|name)=[\"']([^\"']+)[\"']", re.IGNORECASE)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a fence closes on the same character, at least as long)."""
    lines, fence = [], ""
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence:
            closing = m is not None and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence)
            if closing and not line.strip().strip(fence[0]):
                fence = ""
            continue
        if m:
            fence = m.group(1)
            continue
        lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        found.update(_HTML_ANCHOR.findall(line))
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[str]:
    out = []
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        m = _REFERENCE.match(line)
        if m:
            out.append(m.group(1))
            continue
        out.extend(_LINK.findall(_INLINE_CODE.sub("", line)))
    return out


def broken_links(files: list[Path], root: Path) -> list[str]:
    """``file: target (why)`` for every relative link of ``files`` that does not resolve inside ``root``."""
    broken = []
    root = root.resolve()
    for md in files:
        for target in links(md):
            if not target or _SCHEME.match(target):
                continue
            file_part, _, anchor = unquote(target).partition("#")
            dest = (md.parent / file_part).resolve() if file_part else md.resolve()
            where = f"{md.relative_to(root)}: {target}"
            if not dest.is_relative_to(root):
                broken.append(f"{where} (outside the repository)")
            elif not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where} (no heading with this anchor)")
    return broken


def _doc_files(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def test_every_relative_link_in_readme_and_docs_resolves() -> None:
    files = _doc_files(ROOT)
    assert len(files) >= 12  # README and the docs pages it points to
    assert sum(len(links(f)) for f in files) >= 50  # the pages do link to one another
    assert broken_links(files, ROOT) == []


def test_readme_is_the_front_door() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    assert DEV_LANE in text  # the development lane, named as it is run


def test_github_anchors() -> None:
    # the anchors GitHub gives these headings, worked out by hand from its rules (github-slugger)
    assert slug("The MTP precision search (`convert --mtp auto`, `tune-mtp`)") == (
        "the-mtp-precision-search-convert---mtp-auto-tune-mtp"
    )
    assert slug("Guarantees (and how they are tested)") == "guarantees-and-how-they-are-tested"
    assert slug("report.json (`schema: mtpquant.validate/2`)") == "reportjson-schema-mtpquantvalidate2"
    assert slug("Qwen3.8-Flash-Next (`qwen4_exp`)") == "qwen38-flash-next-qwen4_exp"
    assert slug("#35: inspect beyond Qwen, and the Qwen skeletons") == "35-inspect-beyond-qwen-and-the-qwen-skeletons"


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# A page\n\n## Part one\n\ntext\n\n## Part one\n\n```\n## Not a heading\n```\n"
    )
    (tmp_path / "README.md").write_text(
        "# Readme\n\n"
        "[ok](docs/a.md) [ok anchor](docs/a.md#part-one) [repeated heading](docs/a.md#part-one-1) [self](#readme)\n"
        "[web](https://example.com/missing.md) [folder](docs/)\n"
        "[gone](docs/b.md) [bad anchor](docs/a.md#part-two) [fenced heading](docs/a.md#not-a-heading)\n"
        "[up and out](../elsewhere.md) [no self anchor](#nowhere)\n"
        "`[in code](docs/c.md)`\n"
        "```\n[in a fence](docs/d.md)\n```\n"
        "[ref]: docs/e.md\n"
    )
    found = broken_links(_doc_files(tmp_path), tmp_path)
    assert found == [
        "README.md: docs/b.md (no such file)",
        "README.md: docs/a.md#part-two (no heading with this anchor)",
        "README.md: docs/a.md#not-a-heading (no heading with this anchor)",
        "README.md: ../elsewhere.md (outside the repository)",
        "README.md: #nowhere (no heading with this anchor)",
        "README.md: docs/e.md (no such file)",
    ]
