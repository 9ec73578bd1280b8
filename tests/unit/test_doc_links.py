"""Every relative link in the README and the docs leads somewhere: the file exists, and an ``#anchor`` names a
heading of the target as GitHub renders anchors (lowercase, punctuation but ``-`` and ``_`` dropped, spaces to
``-``, ``-1`` for a repeated heading)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"#{1,6} (.*)")


def outside_code_fences(path: Path) -> list[str]:
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    seen: Counter[str] = Counter()
    found = set()
    for line in outside_code_fences(path):
        match = HEADING.match(line)
        if match is None:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1)).strip()
        slug = re.sub(r"[^\w\- ]", "", text.lower().replace("`", "")).replace(" ", "-")
        found.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
        seen[slug] += 1
    return found


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """``name: problem`` for each relative link of ``path`` that leads nowhere (``name`` relative to ``root``)."""
    broken = []
    for target in LINK.findall("\n".join(outside_code_fences(path))):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        file, _, anchor = target.partition("#")
        destination = (path.parent / file).resolve() if file else path.resolve()
        if not destination.exists():
            broken.append(f"{path.relative_to(root)}: no file {target}")
        elif anchor and (destination.suffix != ".md" or anchor not in anchors(destination)):
            broken.append(f"{path.relative_to(root)}: no heading for {target}")
    return broken


def test_every_relative_link_in_the_docs_resolves() -> None:
    documents = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "deploy" / "README.md"]
    assert len(documents) > 10, "the README, the design record, the protocol and the guide are read"
    assert [problem for document in documents for problem in broken_links(document)] == []


def test_a_broken_anchor_is_found(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Title\n\n## Some `code` here\n")
    (tmp_path / "b.md").write_text("[ok](a.md#some-code-here) [bad](a.md#nowhere) [gone](c.md)\n")
    assert broken_links(tmp_path / "b.md", tmp_path) == [
        "b.md: no heading for a.md#nowhere",
        "b.md: no file c.md",
    ]
