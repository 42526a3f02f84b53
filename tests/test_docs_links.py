"""The README and docs/ point only at what exists: every relative link (and its #anchor), every docs/... path
and every *.md file they name resolves, and so does every docs page the code names; the README keeps its two
set-up commands and stays short."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 160

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DOCS_PATH = re.compile(r"(?<![\w/.-])docs/[\w./-]*[\w/]")
MD_NAME = re.compile(r"(?<![\w/.-])([\w.-]+\.md)\b")


def prose_and_headings(path: Path) -> tuple[list[str], list[str]]:
    """The lines outside fenced code blocks, and the headings among them."""
    prose, headings, fenced = [], [], False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        prose.append(line)
        if re.match(r"#{1,6} ", line):
            headings.append(line.lstrip("#").strip())
    return prose, headings


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as hyphens, repeats
    numbered."""
    seen: dict[str, int] = {}
    out = set()
    for heading in prose_and_headings(path)[1]:
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def broken_links(page: Path) -> list[str]:
    """The relative links of a page (outside code blocks) whose file or #anchor does not exist."""
    broken = []
    for line in prose_and_headings(page)[0]:
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            if not dest.exists():
                broken.append(f"{target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{target}: no heading with that anchor")
    return broken


def missing_files(page: Path, root: Path = ROOT) -> list[str]:
    """docs/... paths (from the repository's root) and bare *.md names (beside the page, at the root or in
    docs/) that a page names, in prose and code blocks alike, and that do not exist."""
    text = page.read_text()
    missing = [p for p in sorted(set(DOCS_PATH.findall(text))) if not (root / p).exists()]
    written = {m.group(1) for m in MD_NAME.finditer(text) if re.search(r"--[\w-]+[ =]$", text[:m.start()])}
    for name in sorted(set(MD_NAME.findall(text)) - written):  # not a file a command is told to write
        if not any((where / name).exists() for where in (page.parent, root, root / "docs")):
            missing.append(name)
    return missing


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_relative_link_resolves(page):
    assert broken_links(page) == [], f"{page_id(page)} links to what does not exist"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_docs_path_and_md_file_named_exists(page):
    assert missing_files(page) == [], f"{page_id(page)} names files that do not exist"


def test_every_docs_page_the_code_names_exists():
    """Code, tests and contrib name docs pages by path (docstrings, help texts, errors): each one exists."""
    missing = []
    for folder in ("core", "plugins", "tests", "contrib"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in {".py", ".md", ".toml", ".yaml", ".yml", ".cpp", ".h"} or path == Path(__file__):
                continue
            for name in set(DOCS_PATH.findall(path.read_text(errors="replace"))):
                if name.endswith(".md") and not (ROOT / name).exists():
                    missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert missing == []


def test_the_readme_has_the_two_set_up_commands_and_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"
    code = "\n".join(re.findall(r"^```[^\n]*\n(.*?)^```", "\n".join(lines), flags=re.S | re.M))
    commands = [line.split("#")[0].strip() for line in code.splitlines() if re.match(r"\s*make\b", line)]
    assert commands == ["make demo", "make test"], "the README sets up with exactly `make demo` and `make test`"
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert re.search(r"^make test\b", (ROOT / ".ci" / "run").read_text(), re.M), "CI runs the README's command"


def test_docs_index_lists_every_page_once():
    index = (DOCS / "index.md").read_text()
    for page in sorted(DOCS.glob("*.md")):
        if page.name != "index.md":
            assert index.count(f"]({page.name})") == 1, f"docs/index.md needs one line for {page.name}"


def test_the_checks_find_what_is_broken(tmp_path):
    """A link to a missing file or heading, and a missing docs/ path or *.md name, are each reported."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# A `code` heading: here\n\n```\n# not a heading\n```\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text("[ok](other.md#a-code-heading-here) [bad](other.md#not-a-heading) [gone](gone.md)\n"
                    "[web](https://example.com/x.md) see docs/other.md, docs/missing.md, other.md and lost.md\n"
                    "`tool --output new.md`\n```\n[in code](nowhere.md)\n```\n")
    assert anchors(tmp_path / "docs" / "other.md") == {"a-code-heading-here"}
    assert broken_links(page) == ["other.md#not-a-heading: no heading with that anchor", "gone.md: no such file"]
    assert missing_files(page, tmp_path) == ["docs/missing.md", "gone.md", "lost.md", "nowhere.md"]
