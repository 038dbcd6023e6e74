"""The documentation's generated parts are current, and what it names exists.

The pages are README.md, docs/*.md and jobs/*/README.md: every `make X` they tell a reader to run is a Makefile
target, every relative link reaches a file (and a heading, when it names one), and the README stays one screen.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(REPO.glob("jobs/*/README.md"))]
README_MAX_BYTES = 15_000

# A link's target, outside code: [text](target) with no space in the target.
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
CODE = re.compile(r"^```.*?^```|`[^`\n]*`", re.S | re.M)


def _page_id(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = CODE.sub("", page.read_text())
    headings = re.findall(r"^#+\s+(.*?)\s*$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_generated_parts_are_current() -> None:
    proc = subprocess.run([sys.executable, "scripts/update_readme.py", "--check"], cwd=REPO,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def test_readme_fits_a_screen() -> None:
    size = (REPO / "README.md").stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size:,} bytes, over {README_MAX_BYTES:,}: move a section to docs/"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_make_target_named_exists(page: Path) -> None:
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([a-zA-Z0-9_-]+):", makefile, re.M))
    # A command is `make x` in backticks or at the start of a line in a code block; prose may say "make targets".
    named = set(re.findall(r"(?:^|`)make ([a-z][a-z0-9-]*)", page.read_text(), re.M))
    assert named <= targets, f"{_page_id(page)} names make targets that do not exist: {sorted(named - targets)}"


def test_readme_names_the_two_commands() -> None:
    readme = (REPO / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in LINK.findall(CODE.sub("", page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: and the like
            continue
        path_part, _, anchor = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        if not linked.is_file():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{_page_id(page)} has broken links: {broken}"


def test_every_page_is_reachable_from_the_index() -> None:
    index = REPO / "docs" / "README.md"
    linked = {(index.parent / target.partition("#")[0]).resolve() for target in LINK.findall(index.read_text())}
    pages = [page for page in PAGES if page not in (REPO / "README.md", index)]
    missing = [_page_id(page) for page in pages if page.resolve() not in linked]
    assert not missing, f"docs/README.md does not link {missing}"
