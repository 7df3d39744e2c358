"""Every link of README.md and docs/*.md to a file of the repository finds it, and a link to a
section (FILE.md#anchor, or #anchor in the same page) finds a heading whose anchor it is, as GitHub
makes them: lowercase, punctuation but - and _ dropped, spaces as -, a repeated heading -1, -2."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def anchors(page: Path) -> set:
    seen: dict = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        if line.startswith("#"):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_the_slug_is_githubs():
    assert re.sub(r"[^\w\- ]", "", "SmolLM2 learns (`experiment=smollm2_arith`): TRL 1.16".lower()).replace(" ", "-") \
        == "smollm2-learns-experimentsmollm2_arith-trl-116"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_find_their_files_and_sections(page):
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{target}: no heading of {where.name} has the anchor #{anchor}")
    assert broken == []
