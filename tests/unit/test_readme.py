"""The README leads to a first run and to the docs: short, every docs page one click away, no link broken."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# a Markdown link's target: [text](target), without a title
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_the_readme_has_at_most_300_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= 300, f"README.md has {lines} lines; move a topic to a docs/ page"


def test_every_docs_page_is_linked_from_the_readme():
    targets = set(LINK.findall(README.read_text()))
    for page in sorted((ROOT / "docs").glob("*.md")):
        link = f"docs/{page.name}"
        assert link in targets, f"README.md does not link {link}"


def test_every_relative_link_of_the_readme_and_the_docs_exists():
    docs = [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "dev").glob("*.md"))]
    for doc in docs:
        for target in LINK.findall(doc.read_text()):
            path = target.split("#", 1)[0]
            if not path or re.match(r"[a-z][a-z0-9+.-]*:", path):  # an anchor, or http:, mailto:, ...
                continue
            assert (doc.parent / path).exists(), f"{doc.relative_to(ROOT)}: the link {target} leads nowhere"
