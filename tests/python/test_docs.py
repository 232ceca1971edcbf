"""The user documentation: a README short enough to read, pages under docs/, and no link to
a file that is not in the repository. Fast: reads files only."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_LIMIT = 15_000
ARCHITECTURE = DOCS / "architecture.md"
PACKAGE = ROOT / "python" / "cp_cache"
# a file named in backticks: `handlers/call.py`, `csrc/store.{h,cpp}`, `tests/python/test_ring.py`
FILE_NAME = re.compile(r"`([\w./-]+(?:\{[\w,]+\})?\.?(?:py|md|json|png|h|cpp|txt|toml|yaml)?)`")
FILE_SUFFIXES = (".py", ".md", ".json", ".png", ".h", ".cpp", ".txt", ".toml")

# [text](target) and ![alt](target), target up to the first space or ")"
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def _pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def _documents() -> list[Path]:
    return [README, *_pages()]


def _links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))  # code blocks hold no links
    return LINK.findall(text)


def _relative(target: str) -> bool:
    return not (re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"))


def test_readme_is_short():
    size = len(README.read_text(encoding="utf-8"))
    assert size <= README_LIMIT, f"README.md has {size} characters, more than {README_LIMIT}"


def test_docs_pages_exist():
    pages = [p for p in _pages() if p != ARCHITECTURE]
    assert len(pages) >= 3, f"docs/ has {len(pages)} pages besides architecture.md: {pages}"


@pytest.mark.parametrize("path", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path):
    missing = []
    for target in _links(path):
        if not _relative(target):
            continue
        file_part = unquote(target.split("#", 1)[0].split("?", 1)[0])
        if not file_part:
            continue
        resolved = (path.parent / file_part).resolve()
        if not resolved.exists():
            missing.append(target)
    assert not missing, f"{path.relative_to(ROOT)} links to files that do not exist: {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]{2,}|`", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {_slug(m) for m in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M)}


@pytest.mark.parametrize("path", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_anchors_resolve(path: Path):
    """A link to a heading of a markdown page (its own or another) names a heading that exists."""
    missing = []
    for target in _links(path):
        if not _relative(target) and not target.startswith("#"):
            continue
        file_part, _, anchor = target.partition("#")
        if not anchor:
            continue
        page = (path.parent / unquote(file_part)).resolve() if file_part else path
        if page.suffix == ".md" and page.exists() and anchor not in _anchors(page):
            missing.append(target)
    assert not missing, f"{path.relative_to(ROOT)} links to headings that do not exist: {missing}"


def test_readme_links_every_page():
    text = README.read_text(encoding="utf-8")
    unlinked = [p.name for p in _pages() if f"(docs/{p.name}" not in text]
    assert not unlinked, f"README.md does not link these docs pages: {unlinked}"


@pytest.mark.parametrize("path", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_design_md(path: Path):
    assert "DESIGN.md" not in path.read_text(encoding="utf-8"), (
        f"{path.relative_to(ROOT)} mentions DESIGN.md, which is not in the repository")


def test_link_pattern_finds_links():
    # the checks above are only as good as the pattern: it must see ordinary and image links
    sample = "see [a](docs/a.md) and ![b](docs/b.png) and [c](https://x.org) and [d](#e)\n```\n[f](g.md)\n```\n"
    text = FENCE.sub("", sample)
    assert LINK.findall(text) == ["docs/a.md", "docs/b.png", "https://x.org", "#e"]
    assert [t for t in LINK.findall(text) if _relative(t)] == ["docs/a.md", "docs/b.png"]
    assert _slug("Side by side with torch_npu and torch's ring") == "side-by-side-with-torch_npu-and-torchs-ring"
    assert _slug("`torch.compile`: graph breaks") == "torchcompile-graph-breaks"


def _named_files(text: str) -> list[str]:
    names = []
    for name in FILE_NAME.findall(text):
        if "/" not in name or not name.endswith(FILE_SUFFIXES + ("}",)):
            continue
        stem, brace, rest = name.partition("{")
        names += [stem + part + rest.split("}", 1)[1] for part in rest.split("}", 1)[0].split(",")] if brace else [name]
    return names


@pytest.mark.parametrize("path", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_named_files_exist(path: Path):
    """A file a page names in backticks (a path with a folder) is in the repository: from the
    root, from the package, or beside the page."""
    missing = [name for name in _named_files(path.read_text(encoding="utf-8"))
               if not any((base / name).exists() for base in (ROOT, PACKAGE, path.parent))]
    assert not missing, f"{path.relative_to(ROOT)} names files that are not in the repository: {missing}"


def test_file_pattern_finds_names():
    sample = "`handlers/call.py`, `csrc/store.{h,cpp}`, `cp_cache.enable()`, `make test`, `a/b.md`"
    assert _named_files(sample) == ["handlers/call.py", "csrc/store.h", "csrc/store.cpp", "a/b.md"]

