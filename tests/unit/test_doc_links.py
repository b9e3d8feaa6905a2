"""Every relative link of the README and docs/*.md points to a file that exists, and every ``#anchor`` to a heading
of its target, slugged as GitHub slugs headings (lower case; punctuation other than ``-`` and ``_`` dropped; spaces
to ``-``; a repeated heading gets ``-1``, ``-2``, ...). Headings inside fenced code blocks are not headings."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*)$")


def slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match:
            s = slug(match.group(2))
            n = seen.get(s, 0)
            seen[s] = n + 1
            found.add(s if n == 0 else f"{s}-{n}")
    return found


def test_slug_matches_githubs():
    assert slug("2026-12-03: bf16 against diffusers' own bf16 pipeline, per family (CPU)") == \
        "2026-12-03-bf16-against-diffusers-own-bf16-pipeline-per-family-cpu"
    assert slug("Choosing the bucket table: `bcg plan`") == "choosing-the-bucket-table-bcg-plan"


def test_every_relative_link_and_anchor_of_the_docs_exists():
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{doc.name}: {target} (no such heading)")
    assert not broken, "broken links: " + "; ".join(broken)
